/**
 * "Apply to notebook": edit the %%perfcheck cell and the earlier cells that built the
 * objects (found by execution count) in one notebook transaction, so one notebook undo
 * (Z, or Ctrl/Cmd+Z, in command mode) restores them all; after a dialog showing the diffs.
 *
 * Reached two ways: the `ttm-apply-to-notebook` DOM event from the view (the live panel
 * and the saved report; see notebook-event.ts), and the command
 * `torchtune-magic:apply-to-notebook`, which applies the active cell's saved report.
 */

import { JupyterFrontEnd } from '@jupyterlab/application';
import { Dialog, Notification, showDialog } from '@jupyterlab/apputils';
import { Cell, ICellModel, ICodeCellModel } from '@jupyterlab/cells';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { Widget } from '@lumino/widgets';
import { cellName, renderDiff } from './code-changes';
import { h } from './dom';
import { APPLY_EVENT, AVAILABLE_ATTR, IApplyOutcome, IApplyRequest } from './notebook-event';
import { ICellChange, MIME_TYPE, parseReport } from './report';

export const APPLY_COMMAND = 'torchtune-magic:apply-to-notebook';

/** The text of a cell for comparing: trailing blank space never counts as a change. */
function normalized(source: string): string {
  return source.replace(/\s+$/, '');
}

interface IResolved {
  change: ICellChange;
  cell: ICellModel;
}

/**
 * Find each cell to edit: the checked cell itself for `execution_count: null`, else the
 * code cell with that execution count (the one still reading `before` if several do).
 * Returns the cells, or why the edit must be refused.
 */
function resolve(panel: NotebookPanel, checked: Cell | null, changes: ICellChange[]): IResolved[] | string {
  const model = panel.content.model;
  if (model === null) {
    return 'the notebook is not loaded';
  }
  const codeCells: ICodeCellModel[] = [];
  for (let i = 0; i < model.cells.length; i++) {
    const cell = model.cells.get(i);
    if (cell.type === 'code') {
      codeCells.push(cell as ICodeCellModel);
    }
  }
  const resolved: IResolved[] = [];
  const problems: string[] = [];
  for (const change of changes) {
    let cell: ICellModel | undefined;
    if (change.execution_count === null) {
      cell = checked?.model;
    } else {
      const candidates = codeCells.filter(c => c.executionCount === change.execution_count);
      cell = candidates.find(c => normalized(c.sharedModel.getSource()) === normalized(change.before)) ?? candidates[0];
    }
    const name = cellName(change);
    if (cell === undefined) {
      problems.push(
        change.execution_count === null
          ? 'the %%perfcheck cell is not in this notebook'
          : `${name} is not in this notebook (it ran elsewhere, or was re-run since)`
      );
    } else if (normalized(cell.sharedModel.getSource()) !== normalized(change.before)) {
      problems.push(`${name} has changed since it ran`);
    } else {
      resolved.push({ change, cell });
    }
  }
  if (problems.length > 0) {
    return `Not applied: ${problems.join('; ')}. Re-run the cells and the %%perfcheck cell, then apply again.`;
  }
  return resolved;
}

/** What the dialog says will change, for one cell or several. */
function restoresAll(cells: number): string {
  return cells === 1
    ? 'this cell changes as shown. One notebook undo (Z, or Ctrl/Cmd+Z, in command mode) restores it.'
    : 'these cells change as shown. One notebook undo (Z, or Ctrl/Cmd+Z, in command mode) restores them all.';
}

/** The dialog's body: what each cell will become, as diffs. */
function preview(changes: ICellChange[], fixes: string[]): Widget {
  const node = h(
    'div',
    { className: 'ttm-report ttm-apply-preview' },
    h('p', { text: `For ${fixes.join(', ')}: ${restoresAll(changes.length)}` }),
    ...changes.map(change => h('div', { className: 'ttm-code-block' }, h('div', { className: 'ttm-code-caption', text: cellName(change) }), renderDiff(change.diff)))
  );
  return new Widget({ node });
}

/**
 * Show the change, then make it as one undoable notebook transaction.
 */
export async function applyToNotebook(
  panel: NotebookPanel,
  checked: Cell | null,
  fixes: string[],
  changes: ICellChange[]
): Promise<IApplyOutcome> {
  const found = resolve(panel, checked, changes);
  if (typeof found === 'string') {
    return { ok: false, message: found };
  }
  const answer = await showDialog({
    title: 'Apply to notebook',
    body: preview(changes, fixes),
    buttons: [Dialog.cancelButton(), Dialog.okButton({ label: 'Apply to notebook' })]
  });
  if (!answer.button.accept) {
    return { ok: false, message: 'Cancelled: no cell was changed.' };
  }
  const again = resolve(panel, checked, changes); // the cells may have changed meanwhile
  if (typeof again === 'string') {
    return { ok: false, message: again };
  }
  const notebook = panel.content;
  const shared = notebook.model!.sharedModel;
  // One transaction with the notebook as origin: its undo manager records one step
  // (per-cell undo managers track only their own cell's edits).
  // (the notebook's Y.UndoManager, not in ISharedNotebook's type: a step of its own)
  const undo = (shared as unknown as { undoManager?: { stopCapturing(): void } }).undoManager;
  undo?.stopCapturing();
  shared.transact(() => {
    for (const { change, cell } of again) {
      const trailing = /\s*$/.exec(cell.sharedModel.getSource())?.[0] ?? '';
      cell.sharedModel.setSource(normalized(change.after) + trailing);
    }
  });
  undo?.stopCapturing();
  // Command mode, focused: the next Z (or Ctrl/Cmd+Z) is the notebook's undo.
  notebook.mode = 'command';
  notebook.activate();
  const names = again.map(r => cellName(r.change)).join(' and ');
  const them = again.length === 1 ? 'it' : 'them';
  return { ok: true, message: `Edited ${names}. One notebook undo (Z or Ctrl/Cmd+Z in command mode) restores ${them}.` };
}

function panelHolding(tracker: INotebookTracker, node: Node): NotebookPanel | null {
  return tracker.find(panel => panel.node.contains(node)) ?? null;
}

function cellHolding(panel: NotebookPanel, node: Node): Cell | null {
  return panel.content.widgets.find(cell => cell.node.contains(node)) ?? null;
}

/** The command and the DOM event handler; marks <body> so the view offers the button. */
export function activateNotebookEdits(app: JupyterFrontEnd, tracker: INotebookTracker): void {
  document.body.setAttribute(AVAILABLE_ATTR, '');

  document.addEventListener(APPLY_EVENT, event => {
    const detail = (event as CustomEvent<IApplyRequest>).detail;
    const target = event.target as Node;
    const panel = panelHolding(tracker, target);
    event.stopPropagation();
    if (panel === null) {
      detail.respond({ ok: false, message: 'This report is not in an open notebook.' });
      return;
    }
    applyToNotebook(panel, cellHolding(panel, target), detail.fixes, detail.cells).then(detail.respond, error =>
      detail.respond({ ok: false, message: `Not applied: ${(error as Error).message}` })
    );
  });

  app.commands.addCommand(APPLY_COMMAND, {
    label: 'Apply %%perfcheck changes to notebook',
    caption: "Edit the active %%perfcheck cell and the earlier cells that built its objects, as its report says",
    isEnabled: () => tracker.activeCell?.model.type === 'code',
    execute: async () => {
      const panel = tracker.currentWidget;
      const cell = tracker.activeCell;
      if (panel === null || cell === null || cell.model.type !== 'code') {
        return;
      }
      const outputs = (cell.model as ICodeCellModel).outputs;
      let edits = null;
      for (let i = outputs.length - 1; i >= 0 && edits === null; i--) {
        const data = outputs.get(i).data[MIME_TYPE];
        if (data !== undefined) {
          edits = parseReport(data).notebook_edits ?? null;
        }
      }
      if (edits === null || edits.cells.length === 0) {
        Notification.info('This cell has no %%perfcheck report with cells to edit.');
        return;
      }
      const outcome = await applyToNotebook(panel, cell, edits.fixes, edits.cells);
      (outcome.ok ? Notification.success : Notification.warning)(outcome.message, { autoClose: 8000 });
    }
  });
}
