/**
 * Code changes: the notebook cells to edit (the earlier cells that built the objects and
 * the checked cell), each finding's own change, and the edits to make by hand; every
 * block copyable, and "Apply to notebook" where the labextension can edit cells.
 */

import { copyText, h, prose } from './dom';
import { APPLY_EVENT, canApplyToNotebook, requestApply } from './notebook-event';
import { ICellChange, IFinding, IReport } from './report';
import { editsScope } from './wording';

export const NO_NOTEBOOK_EDITS =
  'Apply to notebook needs JupyterLab or Notebook 7 with the torchtune-magic extension; ' +
  'here, copy the cells below, or run `%perfcheck insert` in a cell.';

function diffLineClass(line: string): string {
  if (line.startsWith('+++') || line.startsWith('---')) {
    return 'ttm-diff-file';
  }
  if (line.startsWith('@@')) {
    return 'ttm-diff-hunk';
  }
  if (line.startsWith('+')) {
    return 'ttm-diff-add';
  }
  if (line.startsWith('-')) {
    return 'ttm-diff-del';
  }
  return 'ttm-diff-context';
}

function copyButton(text: string, label: string, what: string): HTMLButtonElement {
  const button = h('button', {
    className: 'ttm-button ttm-copy',
    text: label,
    title: `Copy ${what} to the clipboard`,
    attrs: { type: 'button' }
  });
  button.addEventListener('click', () => {
    copyText(text);
    button.textContent = 'Copied';
    window.setTimeout(() => (button.textContent = label), 1500);
  });
  return button;
}

/** A unified diff, each line coloured by what it does. */
export function renderDiff(diff: string): HTMLElement {
  const pre = h('pre', { className: 'ttm-diff' });
  for (const line of diff.replace(/\n$/, '').split('\n')) {
    pre.appendChild(h('span', { className: diffLineClass(line), text: `${line}\n` }));
  }
  return pre;
}

/** "In[3]", or "this cell" for the %%perfcheck cell itself. */
export function cellName(change: ICellChange): string {
  return change.execution_count === null ? 'this cell (%%perfcheck)' : `In[${change.execution_count}]`;
}

function cellBlock(change: ICellChange): HTMLElement {
  return h(
    'div',
    { className: 'ttm-code-block', attrs: { 'data-cell': change.execution_count === null ? 'this' : String(change.execution_count) } },
    h('div', { className: 'ttm-code-caption' }, h('span', { text: cellName(change) }), copyButton(change.after, 'Copy cell', `${cellName(change)} as changed`)),
    renderDiff(change.diff)
  );
}

function diffBlock(diff: string): HTMLElement {
  return h(
    'div',
    { className: 'ttm-code-block' },
    h('div', { className: 'ttm-code-caption' }, h('span', { text: 'In this cell' }), copyButton(diff, 'Copy', 'the diff')),
    renderDiff(diff)
  );
}

function elsewhereBlock(items: string[]): HTMLElement {
  return h(
    'div',
    { className: 'ttm-code-block' },
    h(
      'div',
      { className: 'ttm-code-caption' },
      h('span', { text: 'Where the objects are created' }),
      copyButton(items.join('\n'), 'Copy', 'these changes')
    ),
    h('ul', { className: 'ttm-elsewhere' }, ...items.map(item => h('li', {}, h('code', {}, ...prose(item)))))
  );
}

/**
 * The "Apply to notebook" button for these cells, with the outcome next to it; or, where
 * no labextension can edit the notebook (VS Code, Colab), why not.
 */
function applyControl(fixes: string[], cells: ICellChange[], label: string): HTMLElement {
  if (!canApplyToNotebook()) {
    return h('div', { className: 'ttm-note ttm-no-notebook-edits' }, ...prose(NO_NOTEBOOK_EDITS));
  }
  const outcome = h('span', { className: 'ttm-apply-outcome', attrs: { role: 'status' } });
  const button = h('button', {
    className: 'ttm-button ttm-apply-notebook',
    text: label,
    title: `Edit ${cells.map(cellName).join(' and ')} in place, after showing the change (one undo restores ${cells.length === 1 ? 'it' : 'them'})`,
    attrs: { type: 'button', 'data-event': APPLY_EVENT }
  });
  button.addEventListener('click', () => {
    outcome.textContent = '';
    outcome.className = 'ttm-apply-outcome';
    requestApply(button, {
      fixes,
      cells,
      respond: result => {
        outcome.textContent = result.message;
        outcome.classList.add(result.ok ? 'ttm-tone-good' : 'ttm-tone-bad');
      }
    });
  });
  return h('div', { className: 'ttm-apply-row' }, button, outcome);
}

function findingChange(finding: IFinding): HTMLElement {
  const change = finding.code_change!;
  const cells = change.cells ?? [];
  return h(
    'div',
    { className: 'ttm-code-change', attrs: { 'data-finding': finding.id } },
    h('div', { className: 'ttm-code-title' }, h('code', { text: finding.id }), ' ', ...prose(finding.title)),
    ...cells.map(cellBlock),
    cells.length === 0 && change.diff !== '' && diffBlock(change.diff),
    change.elsewhere.length > 0 && elsewhereBlock(change.elsewhere),
    cells.length > 0 && applyControl([finding.id], cells, `Apply ${finding.id} to notebook`)
  );
}

/**
 * The code-changes section, or null when nothing changes. `open` says whether it starts
 * expanded; `onToggle` hears the user open or close it (the live panel keeps that state).
 */
export function renderCodeChanges(
  report: IReport,
  open: boolean,
  onToggle?: (open: boolean) => void
): HTMLElement | null {
  const withChanges = report.findings.filter(
    f => f.code_change && (f.code_change.diff !== '' || f.code_change.elsewhere.length > 0 || (f.code_change.cells ?? []).length > 0)
  );
  const edits = report.notebook_edits;
  if (withChanges.length === 0 && !edits) {
    return null;
  }
  const section = h(
    'details',
    { className: 'ttm-section ttm-code-changes' },
    h('summary', {}, h('h4', { text: 'Code changes' }))
  );
  section.open = open;
  if (onToggle) {
    // the toggle event also follows the `open` set above: pass on only the user's changes
    section.addEventListener('toggle', () => {
      if (section.open !== open) {
        onToggle(section.open);
      }
    });
  }
  if (edits && edits.cells.length > 0) {
    const scope = editsScope(report);
    section.appendChild(
      h(
        'div',
        { className: 'ttm-notebook-edits' },
        h('div', { className: 'ttm-code-intro' }, ...prose(`To make ${scope} permanent, edit ${edits.cells.map(cellName).join(' and ')}:`)),
        applyControl(edits.fixes, edits.cells, 'Apply to notebook'),
        ...edits.cells.map(cellBlock)
      )
    );
    if (withChanges.length > 0) {
      section.appendChild(
        h('details', { className: 'ttm-by-finding', attrs: { 'data-ttm-key': 'by-finding' } }, h('summary', { text: "Each finding's change" }), ...withChanges.map(findingChange))
      );
    }
  } else {
    withChanges.forEach(finding => section.appendChild(findingChange(finding)));
  }
  return section;
}
