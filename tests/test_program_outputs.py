"""`programs/outputs.py`: verify's comparison tells a clock reading from a real difference."""

from __future__ import annotations

import base64
import io

import pytest

from torchtune_magic.programs import outputs


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("Train time on cpu: 12.345 seconds", "Train time on cpu: <time>"),
        ("Epoch 1 took 3.2s", "Epoch 1 took <time>"),
        ("100%|██| 10/10 [00:01<00:00,  7.53it/s]", "100%|██| 10/10 <time>"),
        ("elapsed 0:00:03.2", "elapsed <time>"),
        ("Time: 0.53 | loss 0.3", "Time: <time> | loss 0.3"),
        ("took 3 s, loss 0.2", "took <time>, loss 0.2"),
        # results stay as printed: a loss, a count, a learning rate, an accuracy
        (
            "Train Epoch: 1 [640/60000 (1%)]\tLoss: 2.301",
            "Train Epoch: 1 [640/60000 (1%)]\tLoss: 2.301",
        ),
        ("Accuracy: 9876/10000 (99%)", "Accuracy: 9876/10000 (99%)"),
        ("100 samples, lr=1e-3", "100 samples, lr=1e-3"),
    ],
)
def test_only_wall_clock_figures_are_masked(line: str, expected: str) -> None:
    assert outputs.masked(line) == expected


def test_text_differing_in_a_time_alone_is_the_same_and_says_which_line() -> None:
    compared = outputs.compare_text(
        "start\nepoch took 1.2 s\nloss 0.5\n", "start\nepoch took 9.8 s\nloss 0.5\n"
    )
    assert compared.same
    assert compared.masked == ["epoch took 1.2 s"]


def test_a_changed_result_is_a_difference_named_by_its_first_line() -> None:
    compared = outputs.compare_text("a\ntook 1 s, loss 0.50\nb\n", "a\ntook 2 s, loss 0.51\nc\n")
    assert not compared.same
    assert compared.difference == "line 2: 'took 1 s, loss 0.50'"


def test_missing_and_extra_lines_are_differences() -> None:
    assert "missing from the other run" in (outputs.compare_text("a\nb\n", "a\n").difference or "")
    assert "goes on" in (outputs.compare_text("a\n", "a\nb\n").difference or "")


def test_a_progress_bar_that_redrew_a_different_number_of_times_reads_the_same() -> None:
    first = (
        "train\n 10%|#  | 1/10 [00:00<00:02]\r 50%|#####| 5/10 [00:01<00:01]"
        "\r100%|##########| 10/10 [00:02<00:00]\n"
    )
    second = "train\n 40%|####| 4/10 [00:00<00:01]\r100%|##########| 10/10 [00:03<00:00]\n"
    assert outputs.compare_text(first, second).same


def _stream(name: str, text: str) -> dict:
    return {"output_type": "stream", "name": name, "text": text}


def test_a_cell_s_streams_compare_whole_however_the_kernel_split_them() -> None:
    split = [
        _stream("stdout", "loss 0.5\nlo"),
        _stream("stderr", "warn\n"),
        _stream("stdout", "ss 0.4\n"),
    ]
    whole = [_stream("stderr", "warn\n"), _stream("stdout", "loss 0.5\nloss 0.4\n")]
    assert outputs.compare_outputs(split, whole).same
    changed = [_stream("stderr", "warn\n"), _stream("stdout", "loss 0.5\nloss 0.3\n")]
    assert outputs.compare_outputs(split, changed).difference == "'stdout: loss 0.4'"


def _png(values: list[float], **savefig: object) -> str:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure = plt.figure(figsize=(2, 2))
    plt.plot(values)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", **savefig)
    plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode()


def test_images_compare_by_their_pixels_not_their_file_bytes() -> None:
    plain = _png([1, 2, 3])
    tagged = _png(
        [1, 2, 3], metadata={"Software": "another writer"}, pil_kwargs={"compress_level": 1}
    )
    assert plain != tagged  # other bytes…
    shown = {"output_type": "display_data", "data": {"image/png": plain, "text/plain": "<Figure>"}}
    same_picture = {
        "output_type": "display_data",
        "data": {"image/png": tagged, "text/plain": "<Figure>"},
    }
    other_picture = {
        "output_type": "display_data",
        "data": {"image/png": _png([3, 2, 1]), "text/plain": "<Figure>"},
    }
    assert outputs.compare_outputs([shown], [same_picture]).same  # …the same picture
    assert not outputs.compare_outputs([shown], [other_picture]).same


def test_an_error_compares_by_its_name_and_message() -> None:
    error = {
        "output_type": "error",
        "ename": "IndexError",
        "evalue": "index 40 is out of bounds",
        "traceback": ["x"],
    }
    moved = dict(error, traceback=["another path"])
    assert outputs.compare_outputs([error], [moved]).same
    assert not outputs.compare_outputs(
        [error], [dict(error, evalue="index 41 is out of bounds")]
    ).same


def test_a_progress_widget_compares_by_its_text_not_its_model_id() -> None:
    def bar(model_id: str, text: str) -> dict:
        view = {"model_id": model_id, "version_major": 2, "version_minor": 0}
        return {
            "output_type": "display_data",
            "data": {outputs.WIDGET_VIEW: view, "text/plain": text},
        }

    assert outputs.compare_outputs(
        [bar("a1", "100% 5/5 [00:01<00:00]")], [bar("b2", "100% 5/5 [00:02<00:00]")]
    ).same


def test_a_warning_s_kernel_file_name_is_masked_its_message_is_not() -> None:
    first = "/tmp/ipykernel_4121/3316471520.py:5: UserWarning: anomaly detection is on\n"
    second = "/tmp/ipykernel_9876/3316471520.py:5: UserWarning: anomaly detection is on\n"
    compared = outputs.compare_outputs([_stream("stderr", first)], [_stream("stderr", second)])
    assert compared.same and compared.masked == [f"stderr: {first.strip()}"]
    other = second.replace("is on", "is off")
    assert not outputs.compare_outputs([_stream("stderr", first)], [_stream("stderr", other)]).same
