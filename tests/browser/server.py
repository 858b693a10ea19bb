"""A real `jupyter lab` server for the browser tests, isolated in a temporary root."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import nbformat
from nbformat.sign import NotebookNotary

# Silence the news / update pop-up so it never covers what the tests look at.
SETTINGS_OVERRIDES = {
    "@jupyterlab/apputils-extension:notification": {
        "checkForUpdates": False,
        "fetchNews": "false",
    }
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class JupyterLab:
    """A running server: its URL, notebook root and process."""

    url: str
    root: Path
    data_dir: Path
    process: subprocess.Popen[bytes]

    def api(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=data, method=method)
        request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, timeout=10) as response:
            payload = response.read()
        return json.loads(payload) if payload else None

    def write_notebook(self, name: str, sources: list[str]) -> str:
        """Write a notebook of code cells (no outputs) into the root; return its name."""
        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = {
            "name": "python3",
            "display_name": "Python 3 (ipykernel)",
            "language": "python",
        }
        nb.cells = [nbformat.v4.new_code_cell(source) for source in sources]
        nbformat.write(nb, self.root / name)
        return name

    def write_saved_notebook(
        self, name: str, source: str, outputs: list[dict[str, Any]], *, trusted: bool
    ) -> str:
        """Write a notebook as if saved by an earlier session: one cell with these display
        outputs and no kernelspec (JupyterLab then asks which kernel to start). A trusted
        one is signed, as JupyterLab signs the notebooks it saves."""
        nb = nbformat.v4.new_notebook()
        cell = nbformat.v4.new_code_cell(source, execution_count=1)
        cell.outputs = [nbformat.v4.new_output("display_data", data=data) for data in outputs]
        nb.cells = [cell]
        if trusted:
            NotebookNotary(data_dir=str(self.data_dir)).sign(nb)
        nbformat.write(nb, self.root / name)
        return name

    def read_notebook(self, name: str) -> nbformat.NotebookNode:
        return nbformat.read(self.root / name, as_version=4)

    def shutdown_kernels(self) -> None:
        """Shut down every kernel through the REST API, as the Kernel menu does."""
        for session in self.api("GET", "/api/sessions"):
            self.api("DELETE", f"/api/sessions/{session['id']}")
        deadline = time.monotonic() + 20
        while self.api("GET", "/api/kernels") and time.monotonic() < deadline:
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def start_jupyter_lab(base: Path, log: IO[bytes]) -> JupyterLab:
    """Start `jupyter lab` on 127.0.0.1 with no token, a temporary root and settings."""
    root = base / "notebooks"
    app_settings = base / "app-settings"
    for folder in (root, app_settings, base / "user-settings", base / "workspaces"):
        folder.mkdir(parents=True, exist_ok=True)
    (app_settings / "overrides.json").write_text(json.dumps(SETTINGS_OVERRIDES))

    port = free_port()
    data_dir = base / "data"  # notebook signatures (trust) of this server only
    env = {
        **os.environ,
        "JUPYTER_DATA_DIR": str(data_dir),
        "JUPYTER_RUNTIME_DIR": str(base / "runtime"),
        "IPYTHONDIR": str(base / "ipython"),
        "TORCHINDUCTOR_CACHE_DIR": str(base / "inductor"),
    }
    command = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--allow-root",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        "--IdentityProvider.token=",
        "--ServerApp.disable_check_xsrf=True",
        f"--ServerApp.root_dir={root}",
        f"--LabApp.app_settings_dir={app_settings}",
        f"--LabApp.user_settings_dir={base / 'user-settings'}",
        f"--LabApp.workspaces_dir={base / 'workspaces'}",
        # window.jupyterapp: tests run commands (theme, undo) as the menus would
        "--LabApp.expose_app_in_browser=True",
    ]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)
    server = JupyterLab(
        url=f"http://127.0.0.1:{port}", root=root, data_dir=data_dir, process=process
    )

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with {process.returncode}; see {log.name}")
        try:
            server.api("GET", "/api/status")
            return server
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.25)
    server.stop()
    raise RuntimeError(f"jupyter lab did not answer within 60 s; see {log.name}")
