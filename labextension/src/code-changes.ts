/** Per-finding code changes: the cell diff and the edits to make elsewhere, each copyable. */

import { Clipboard } from '@jupyterlab/apputils';
import { h } from './dom';
import { IFinding } from './report';

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

function copyButton(text: string, what: string): HTMLButtonElement {
  const button = h('button', {
    className: 'jp-Button jp-mod-styled jp-mod-reject ttm-copy',
    text: 'Copy',
    title: `Copy ${what} to the clipboard`,
    attrs: { type: 'button' }
  });
  button.addEventListener('click', () => {
    Clipboard.copyToSystem(text);
    button.textContent = 'Copied';
    window.setTimeout(() => (button.textContent = 'Copy'), 1500);
  });
  return button;
}

function renderDiff(diff: string): HTMLElement {
  const lines = diff.replace(/\n$/, '').split('\n');
  const pre = h('pre', { className: 'ttm-diff' });
  for (const line of lines) {
    pre.appendChild(h('span', { className: diffLineClass(line), text: `${line}\n` }));
  }
  return h(
    'div',
    { className: 'ttm-code-block' },
    h('div', { className: 'ttm-code-caption' }, h('span', { text: 'In this cell' }), copyButton(diff, 'the diff')),
    pre
  );
}

function renderElsewhere(items: string[]): HTMLElement {
  return h(
    'div',
    { className: 'ttm-code-block' },
    h(
      'div',
      { className: 'ttm-code-caption' },
      h('span', { text: 'Where the objects are created' }),
      copyButton(items.join('\n'), 'these changes')
    ),
    h('ul', { className: 'ttm-elsewhere' }, ...items.map(item => h('li', {}, h('code', { text: item }))))
  );
}

/** The code-changes section, or null when no finding proposes a change. */
export function renderCodeChanges(findings: IFinding[]): HTMLElement | null {
  const withChanges = findings.filter(
    f => f.code_change && (f.code_change.diff !== '' || f.code_change.elsewhere.length > 0)
  );
  if (withChanges.length === 0) {
    return null;
  }
  return h(
    'section',
    { className: 'ttm-section ttm-code-changes' },
    h('h4', { text: 'Code changes' }),
    ...withChanges.map(finding => {
      const change = finding.code_change!;
      return h(
        'div',
        { className: 'ttm-code-change', attrs: { 'data-finding': finding.id } },
        h('div', { className: 'ttm-code-title' }, h('code', { text: finding.id }), ` ${finding.title}`),
        change.diff !== '' && renderDiff(change.diff),
        change.elsewhere.length > 0 && renderElsewhere(change.elsewhere)
      );
    })
  );
}
