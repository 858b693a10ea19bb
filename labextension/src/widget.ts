/**
 * The live panel as an anywidget ES module (bundled to `torchtune_magic/static/widget.js`).
 *
 * It draws the same view as the saved report (view.ts) from the synced state of
 * `torchtune_magic.render.widget.PanelWidget` and sends the user's commands to the kernel
 * as custom messages; the kernel does everything else. No JupyterLab import here: this
 * runs in JupyterLab, Notebook 7, VS Code and Colab alike.
 *
 * The host element carries `ttm-live-panel ttm-run-<run_id>` from the widget's
 * `_dom_classes`: coexist.ts hides the saved report of the same run while it is mounted.
 */

import { IActions, ILiveState, IRowMessage, renderProgress, renderReport } from './view';
import { IReport, parseReport } from './report';
import { h } from './dom';
import { MEASURING } from './wording';

/** The part of anywidget's model interface this module uses. */
interface IModel {
  get(name: string): unknown;
  on(event: string, callback: () => void): void;
  off(event: string, callback: () => void): void;
  send(content: Record<string, unknown>): void;
}

const SYNCED = ['report', 'run_id', 'attached', 'busy', 'progress', 'progress_message', 'messages', 'notice', 'code_open'];
const PROGRESS = ['progress', 'progress_message'];

function state(model: IModel): ILiveState {
  return {
    runId: String(model.get('run_id') ?? ''),
    attached: Boolean(model.get('attached')),
    busy: Boolean(model.get('busy')),
    progress: Number(model.get('progress') ?? 0),
    progressMessage: String(model.get('progress_message') ?? ''),
    messages: (model.get('messages') as Record<string, IRowMessage>) ?? {},
    notice: String(model.get('notice') ?? ''),
    codeOpen: Boolean(model.get('code_open'))
  };
}

function actions(model: IModel): IActions {
  return {
    toggle: (id, on) => model.send({ command: 'toggle', id, on }),
    retime: () => model.send({ command: 'retime' }),
    applyWins: () => model.send({ command: 'apply_wins' }),
    revertAll: () => model.send({ command: 'revert_all' }),
    showCode: open => model.send({ command: 'show_code', open })
  };
}

/** Which collapsible parts the user opened or closed, to keep across redraws. */
function openStates(el: HTMLElement): Map<string, boolean> {
  const states = new Map<string, boolean>();
  el.querySelectorAll<HTMLDetailsElement>('details[data-ttm-key]').forEach(d => states.set(d.dataset.ttmKey as string, d.open));
  return states;
}

function draw(model: IModel, el: HTMLElement): void {
  const live = { state: state(model), actions: actions(model) };
  const kept = openStates(el);
  const data = model.get('report');
  let view: HTMLElement;
  if (data === null || data === undefined) {
    view = h('div', { className: 'ttm-report' }, h('h3', { text: '%%perfcheck' }), h('div', { className: 'ttm-status', text: 'running the cell, then measuring…' }));
    const progress = renderProgress(live.state);
    if (progress) {
      view.appendChild(progress);
    }
  } else {
    let report: IReport;
    try {
      report = parseReport(data);
    } catch (error) {
      el.replaceChildren(h('div', { className: 'ttm-invalid', text: `Cannot show the %%perfcheck report: ${(error as Error).message}` }));
      return;
    }
    view = renderReport(report, live);
  }
  view.querySelectorAll<HTMLDetailsElement>('details[data-ttm-key]').forEach(d => {
    const open = kept.get(d.dataset.ttmKey as string);
    if (open !== undefined) {
      d.open = open;
    }
  });
  el.replaceChildren(view);
}

/**
 * Progress moves with every measuring run: update the bar and its message in place. A
 * full redraw (parse the report, rebuild every table and the chart) costs the browser
 * tens of milliseconds on a slow machine, and the kernel's next timed run shares that
 * machine's CPUs with it.
 */
function moveProgress(model: IModel, el: HTMLElement): boolean {
  const box = el.querySelector('.ttm-progress');
  const bar = box?.querySelector('progress');
  const message = box?.querySelector('.ttm-progress-message');
  if (!box || !bar || !message || !model.get('busy')) {
    return false;
  }
  bar.value = Math.max(0, Math.min(1, Number(model.get('progress') ?? 0)));
  message.textContent = String(model.get('progress_message') ?? '') || MEASURING;
  return true;
}

function render({ model, el }: { model: IModel; el: HTMLElement }): () => void {
  el.classList.add('ttm-panel-host');
  const redraw = () => draw(model, el);
  const progress = () => {
    if (!moveProgress(model, el)) {
      redraw();
    }
  };
  const handlers = SYNCED.map(name => [name, PROGRESS.includes(name) ? progress : redraw] as const);
  handlers.forEach(([name, handler]) => model.on(`change:${name}`, handler));
  redraw();
  return () => handlers.forEach(([name, handler]) => model.off(`change:${name}`, handler));
}

export default { render };
