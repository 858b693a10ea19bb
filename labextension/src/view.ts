/**
 * The one view of a %%perfcheck report: the saved report (MIME renderer) and the live
 * panel (anywidget) both draw it from here, so they cannot drift. The live panel adds
 * controls (toggles, buttons, progress, per-row messages), all inside `.ttm-live-only`
 * elements; everything else reads the same in both.
 *
 * Every string from the report becomes a text node (see dom.ts): nothing is parsed as HTML.
 */

import { renderChart, renderLossCurves } from './chart';
import { renderCodeChanges } from './code-changes';
import { Child, h, prose } from './dom';
import { formatBytes, formatSeconds } from './format';
import {
  IChecked,
  IFinding,
  IReport,
  IVariant,
  earlierMeasurements,
  isMeasuring,
  isNoGain,
  isWin,
  latestVariants,
  soloVariant
} from './report';
import { flopsBreakdown, throughputBadge, throughputItems } from './throughput';
import * as words from './wording';

const NOISY_TITLE = 'IQR above 10% of the median: treat this figure with caution';

/** A message shown in a finding's row, e.g. why its fix was refused. */
export interface IRowMessage {
  text: string;
  kind: 'refused' | 'error' | 'info';
  /** Offer re-running the cell (the fix refused because a name was rebound since). */
  rerun?: boolean;
}

/** What the live panel's kernel side holds besides the report (synced traitlets). */
export interface ILiveState {
  runId: string;
  /** The session is attached: toggles and buttons act on the live objects. */
  attached: boolean;
  /** Measuring or running: controls are off, progress is shown. */
  busy: boolean;
  progress: number;
  progressMessage: string;
  messages: Record<string, IRowMessage>;
  /** A message for the whole panel (an action that failed), or "". */
  notice: string;
  codeOpen: boolean;
}

/** The commands the live panel sends to the kernel. */
export interface IActions {
  toggle(findingId: string, on: boolean): void;
  retime(): void;
  applyWins(): void;
  revertAll(): void;
  showCode(open: boolean): void;
}

export interface ILive {
  state: ILiveState;
  actions: IActions;
}

export const RERUN_HINT = 'Re-run the %%perfcheck cell to check the objects as they are now.';

function badge(text: string, className: string, title?: string): HTMLElement {
  return h('span', { className: `ttm-badge ${className}`, text, title });
}

function noisyBadge(): HTMLElement {
  return badge('noisy', 'ttm-badge-noisy', NOISY_TITLE);
}

function liveOnly<K extends keyof HTMLElementTagNameMap>(tag: K, className: string): HTMLElementTagNameMap[K] {
  return h(tag, { className: `ttm-live-only ${className}` });
}

function renderHeader(report: IReport, live?: ILive): HTMLElement {
  const env = report.environment;
  const base = report.baseline;
  const threads = env.torch_threads !== undefined ? `, ${env.torch_threads} torch threads` : '';
  const items: [string, string | Node[], string?][] = [
    ['Device', `${env.device_name} (${env.device}, ${words.count(env.cpu_count, 'CPU')}${threads})`],
    ['PyTorch', env.torch],
    [
      'Baseline',
      [
        document.createTextNode(
          words.baselineTime(report)
        ),
        ...(base.noisy ? [noisyBadge()] : [])
      ]
    ],
    ['Runs', base.median_s === null ? '—' : words.count(base.runs, 'run')],
    ['Peak memory', formatBytes(base.peak_memory_bytes), env.memory_measure],
    ...throughputItems(report)
  ];
  if (base.projected_cell_s !== null && base.projected_cell_s !== undefined) {
    items.push(['Whole cell', `${formatSeconds(base.projected_cell_s)} (projected)`]);
  }
  const sampled = words.sampling(report);
  if (sampled) {
    items.push(['Sampled', sampled.replace(/^sampled: /, '')]);
  }
  const load = words.load(report);
  if (load) {
    items.push(['Machine', load]);
  }
  const job = words.distributed(report);
  if (job) {
    items.push(['Ranks', job]);
  }
  const run = words.cellRun(report);
  if (run) {
    items.push(["The cell's run", run]);
  }
  if (report.elapsed_s !== null && report.elapsed_s !== undefined) {
    const budget = report.budget_s ? ` of a ${formatSeconds(report.budget_s)} budget` : '';
    items.push(['Measured in', `${formatSeconds(report.elapsed_s)}${budget}`]);
  }
  const list = h('dl', { className: 'ttm-summary' });
  for (const [term, value, title] of items) {
    list.appendChild(h('dt', { text: term }));
    list.appendChild(h('dd', { title }, ...(typeof value === 'string' ? prose(value) : value)));
  }
  const status = [words.phase(report), words.oom(report)].filter(Boolean);
  return h(
    'header',
    { className: 'ttm-header' },
    h('h3', { text: '%%perfcheck report' }),
    renderTimeSplit(report),
    ...status.map(line => h('div', { className: `ttm-status ttm-phase-${report.phase ?? 'done'}` }, ...prose(line))),
    live && renderProgress(live.state),
    list,
    flopsBreakdown(report)
  );
}

/** Where the time went, first under the title: a stacked bar (each part's width its share)
 * and its line. */
function renderTimeSplit(report: IReport): HTMLElement | null {
  const shares = words.splitShares(report);
  if (shares.length === 0) {
    return null;
  }
  const bar = h(
    'div',
    { className: 'ttm-time-split-bar', attrs: { role: 'img', 'aria-label': words.splitLine(report) } },
    ...shares.map(([key, name, share]) =>
      h('span', {
        className: `ttm-split-part ttm-split-${key}`,
        title: `${name} ${Math.round(share * 100)}%`,
        attrs: { style: `width: ${(share * 100).toFixed(2)}%` }
      })
    )
  );
  return h(
    'div',
    { className: 'ttm-time-split' },
    bar,
    h('div', { className: 'ttm-time-split-line', text: words.splitLine(report) })
  );
}

/** The progress bar and what is being measured ("round 2 of 5: debug-anomaly"). */
export function renderProgress(state: ILiveState): HTMLElement | null {
  if (!state.busy) {
    return null;
  }
  const box = liveOnly('div', 'ttm-progress');
  const bar = h('progress', { attrs: { max: '1' } });
  bar.value = Math.max(0, Math.min(1, state.progress));
  box.append(bar, h('span', { className: 'ttm-progress-message', text: state.progressMessage || words.MEASURING }));
  return box;
}

function toneClass(tone: words.Tone): string {
  return `ttm-tone-${tone}`;
}

function speedupCell(report: IReport, finding: IFinding, variant: IVariant | undefined): HTMLElement {
  const cell = h('td', { className: 'ttm-speedup' });
  if (!finding.fixable) {
    cell.textContent = 'not auto-fixable';
    cell.classList.add('ttm-muted');
    return cell;
  }
  const earlier = variant ? earlierMeasurements(report, variant) : [];
  const worded = words.speedup(report, variant);
  cell.appendChild(h('span', { className: `ttm-speedup-text ${toneClass(worded.tone)}` }, ...prose(worded.text)));
  if (variant?.noisy) {
    cell.appendChild(noisyBadge());
  }
  if (variant && variant.speedup !== null && variant.error === null) {
    const whole = words.projected(report, variant);
    if (whole) {
      cell.appendChild(h('div', { className: 'ttm-note ttm-projected', text: whole }));
    }
    const oneTime = words.oneTime(variant);
    if (oneTime) {
      cell.appendChild(h('div', { className: 'ttm-note ttm-one-time', text: oneTime }));
    }
    const before = words.measuredBefore(report, variant);
    if (before) {
      cell.appendChild(h('div', { className: 'ttm-note ttm-measured-before', text: before }));
    }
    const throughput = throughputBadge(variant, report);
    if (throughput) {
      cell.appendChild(h('div', { className: 'ttm-throughput' }, throughput));
    }
  }
  if (earlier.length > 0) {
    cell.appendChild(h('div', { className: 'ttm-note ttm-earlier', text: words.earlier(earlier) }));
  }
  return cell;
}

function memoryCell(report: IReport, variant: IVariant | undefined): HTMLElement {
  const worded = words.memory(report, variant);
  if (worded === null) {
    return h('td', { className: 'ttm-memory ttm-muted', text: '—' });
  }
  return h('td', { className: 'ttm-memory' }, badge(worded.text, `ttm-badge-memory ${toneClass(worded.tone)}`, worded.title));
}

/** Whether the fix left what the cell produced the same: identical, close, changed… */
function numericsBadge(variant: IVariant): HTMLElement {
  const { verdict, max_rel_diff, detail } = variant.numerics;
  const parts = [max_rel_diff !== null ? `max relative difference ${max_rel_diff.toExponential(2)}` : '', detail ?? ''];
  const title = parts.filter(Boolean).join('; ') || undefined;
  return badge(words.results(variant.numerics), `ttm-verdict ttm-verdict-${verdict}`, title);
}

/** A training cell's loss against the baseline's, the two curves drawn where they differ. */
function lossNote(variant: IVariant): HTMLElement | null {
  const worded = words.loss(variant);
  if (worded === null) {
    return null;
  }
  return h(
    'div',
    { className: `ttm-note ttm-loss ${toneClass(worded.tone)}` },
    worded.text,
    words.lossCurvesDiffer(variant) && renderLossCurves(variant)
  );
}

function numericsCell(variant: IVariant | undefined): HTMLElement {
  if (variant === undefined || variant.error !== null || variant.speedup === null) {
    return h('td', { className: 'ttm-muted', text: '—' });
  }
  return h('td', {}, numericsBadge(variant), lossNote(variant));
}

function toggleControl(finding: IFinding, applied: boolean, live: ILive): HTMLElement {
  const input = h('input', { attrs: { type: 'checkbox' }, title: 'Apply this fix to the live objects now' });
  input.checked = applied;
  input.disabled = !live.state.attached || live.state.busy;
  input.addEventListener('change', () => live.actions.toggle(finding.id, input.checked));
  const label = liveOnly('label', 'ttm-toggle');
  label.append(input, document.createTextNode(' apply'));
  return label;
}

function rowMessage(message: IRowMessage | undefined): HTMLElement | null {
  if (message === undefined) {
    return null;
  }
  const box = liveOnly('div', `ttm-row-message ttm-row-${message.kind}`);
  box.setAttribute('role', 'alert');
  box.appendChild(h('span', {}, ...prose(message.text)));
  if (message.rerun) {
    box.appendChild(h('div', { className: 'ttm-rerun', text: RERUN_HINT }));
  }
  return box;
}

function findingRow(report: IReport, finding: IFinding, live?: ILive): HTMLElement {
  const variant = soloVariant(report, finding.id);
  const applied = (report.applied ?? []).includes(finding.id);
  return h(
    'tr',
    { attrs: { 'data-finding': finding.id } },
    h(
      'td',
      { className: 'ttm-finding' },
      live && finding.fixable && toggleControl(finding, applied, live),
      h('code', { className: 'ttm-finding-id', text: finding.id }),
      applied && badge('applied', 'ttm-badge-applied', 'This fix is applied to the live objects'),
      h('div', { className: 'ttm-finding-title' }, ...prose(finding.title)),
      finding.guide && h('div', { className: 'ttm-note' }, 'Guide: ', ...prose(finding.guide)),
      finding.caveat && h('div', { className: 'ttm-note ttm-caveat' }, 'Caveat: ', ...prose(finding.caveat)),
      live && rowMessage(live.state.messages[finding.id])
    ),
    evidenceCell(report, finding),
    h('td', { className: 'ttm-where' }, ...prose(finding.where)),
    speedupCell(report, finding, variant),
    memoryCell(report, variant),
    numericsCell(variant)
  );
}

/** The part of the time split a fix acts on: a chip in that part's colour, with its share. */
function segmentChip(report: IReport, finding: IFinding): HTMLElement | null {
  if (!finding.segment) {
    return null;
  }
  const worded = words.segment(report, finding.segment);
  return h(
    'div',
    { className: 'ttm-segment', title: worded.title, attrs: { 'data-segment': finding.segment } },
    h('span', { className: `ttm-segment-swatch ttm-split-${finding.segment}` }),
    worded.text
  );
}

/** One sentence with its key figure first; what else the check saw folds out. */
function evidenceCell(report: IReport, finding: IFinding): HTMLElement {
  return h(
    'td',
    { className: 'ttm-evidence' },
    segmentChip(report, finding),
    h('div', { className: 'ttm-evidence-lead' }, ...prose(finding.evidence)),
    finding.details &&
      h(
        'details',
        { className: 'ttm-details', attrs: { 'data-ttm-key': `details-${finding.id}` } },
        h('summary', { text: 'details' }),
        h('div', { className: 'ttm-details-text' }, ...prose(finding.details))
      )
  );
}

function findingsTable(report: IReport, findings: IFinding[], live?: ILive): HTMLElement {
  const head = h(
    'thead',
    {},
    h('tr', {}, ...['Finding', 'Evidence', 'Where', 'Fix alone', 'Memory', 'Results'].map(t => h('th', { text: t })))
  );
  return h('table', { className: 'ttm-findings' }, head, h('tbody', {}, ...findings.map(f => findingRow(report, f, live))));
}

function renderFindings(report: IReport, live?: ILive): HTMLElement[] {
  const noGain = report.findings.filter(f => isNoGain(report, f));
  const act = report.findings.filter(f => !isNoGain(report, f));
  const section = h('section', { className: 'ttm-section ttm-act' }, h('h4', { text: `Findings (${act.length})` }));
  if (report.findings.length === 0) {
    section.appendChild(h('p', { text: 'No findings: nothing in this cell matches the tuning guide\'s checks.' }));
  } else if (act.length === 0) {
    section.appendChild(h('p', { text: 'Nothing to act on: every fix was measured and gained nothing clear here.' }));
  } else {
    section.appendChild(findingsTable(report, act, live));
  }
  const sections: HTMLElement[] = [section];
  if (noGain.length > 0) {
    sections.push(
      h(
        'details',
        { className: 'ttm-section ttm-no-gain', attrs: { 'data-ttm-key': 'no-gain' } },
        h('summary', { text: `checked: no gain here (${noGain.length})` }),
        h('p', { className: 'ttm-note', text: 'These checks fired, and their fixes, measured alone, gained nothing clear on this machine.' }),
        findingsTable(report, noGain, live)
      )
    );
  }
  return [...sections, ...renderChecked(report)];
}

/** Checks whose own trial settled them here ("checked: slower here"), one group per outcome. */
function renderChecked(report: IReport): HTMLElement[] {
  const groups = new Map<string, IChecked[]>();
  for (const item of report.checked ?? []) {
    groups.set(item.outcome, [...(groups.get(item.outcome) ?? []), item]);
  }
  return Array.from(groups, ([outcome, items]) =>
    h(
      'details',
      { className: 'ttm-section ttm-checked', attrs: { 'data-ttm-key': `checked-${outcome}`, 'data-outcome': outcome } },
      h('summary', { text: `checked: ${outcome} (${items.length})` }),
      h(
        'ul',
        {},
        ...items.map(item =>
          h(
            'li',
            { attrs: { 'data-check': item.id } },
            h('code', { className: 'ttm-finding-id', text: item.id }),
            ' ',
            h('span', { className: 'ttm-finding-title' }, ...prose(item.title)),
            h('div', { className: 'ttm-checked-evidence' }, ...prose(item.evidence))
          )
        )
      )
    )
  );
}

function renderTogether(report: IReport): HTMLElement[] {
  return latestVariants(report)
    .filter(v => v.fixes.length > 1)
    .map(v => {
      const worded = words.speedup(report, v);
      const memory = words.memory(report, v);
      const extras = [words.projected(report, v), words.oneTime(v), words.measuredBefore(report, v)].filter(Boolean);
      const earlier = words.earlier(earlierMeasurements(report, v));
      return h(
        'p',
        { className: 'ttm-combined' },
        `${words.combinedLabel(report, v)}: `,
        h('span', { className: `ttm-speedup-text ${toneClass(worded.tone)}` }, ...prose(worded.text)),
        v.noisy && noisyBadge(),
        memory && badge(memory.text, `ttm-badge-memory ${toneClass(memory.tone)}`, memory.title),
        v.error === null && v.speedup !== null && numericsBadge(v),
        throughputBadge(v, report),
        extras.length > 0 && h('span', { className: 'ttm-note' }, ...prose(` · ${extras.join(' · ')}`)),
        earlier && h('span', { className: 'ttm-note ttm-earlier', text: ` · ${earlier}` })
      );
    });
}

function renderActions(report: IReport, live: ILive): HTMLElement | null {
  const fixable = report.findings.some(f => f.fixable);
  const box = liveOnly('div', 'ttm-actions');
  if (fixable) {
    const off = !live.state.attached || live.state.busy;
    const wins = report.findings.some(f => f.fixable && isWin(soloVariant(report, f.id)) && !(report.applied ?? []).includes(f.id));
    const button = (text: string, title: string, action: () => void, disabled = off) => {
      const node = h('button', { className: 'ttm-button', text, title, attrs: { type: 'button' } });
      node.disabled = disabled;
      node.addEventListener('click', action);
      return node;
    };
    box.append(
      button('Re-time', 'Measure the fixes applied (together and each alone) against the baseline; with none applied, every fix again', () =>
        live.actions.retime()
      ),
      button('Apply all measured wins', 'Apply every fix measured clearly faster than the baseline', () => live.actions.applyWins(), off || !wins),
      button('Revert all', 'Undo every applied fix', () => live.actions.revertAll(), off || (report.applied ?? []).length === 0),
      button(live.state.codeOpen ? 'Hide code' : 'Show code', 'The code changes that make the fixes permanent', () =>
        live.actions.showCode(!live.state.codeOpen), false)
    );
  }
  if (live.state.notice) {
    box.appendChild(h('div', { className: 'ttm-notice', attrs: { role: 'alert' } }, ...prose(live.state.notice)));
  }
  return box.childElementCount > 0 ? box : null;
}

function renderNotApplicable(report: IReport): HTMLElement | null {
  const items = report.not_applicable ?? [];
  if (items.length === 0) {
    return null;
  }
  return h(
    'details',
    { className: 'ttm-section ttm-not-applicable', attrs: { 'data-ttm-key': 'not-applicable' } },
    h('summary', { text: `Not applicable here (${items.length})` }),
    h(
      'ul',
      {},
      ...words.byReason(items).map(([ids, reason]) =>
        h('li', {}, ...ids.flatMap((id, i): Child[] => [i > 0 && ', ', h('code', { text: id })]), ' — ', ...prose(reason))
      )
    )
  );
}

function renderOwnFailures(report: IReport): HTMLElement | null {
  const items = report.failures ?? [];
  if (items.length === 0) {
    return null;
  }
  return h(
    'section',
    { className: 'ttm-section ttm-own-failures' },
    h('h4', { text: words.OWN_FAILURES }),
    h(
      'ul',
      {},
      ...items.map(f =>
        h('li', {}, h('details', {}, h('summary', {}, ...prose(words.ownFailureLine(f))), h('pre', { text: f.traceback ?? '' })))
      )
    )
  );
}

function renderWarnings(report: IReport): HTMLElement | null {
  const items = report.warnings ?? [];
  if (items.length === 0) {
    return null;
  }
  return h('section', { className: 'ttm-section ttm-warnings' }, h('h4', { text: 'Warnings' }), h('ul', {}, ...items.map(w => h('li', {}, ...prose(w)))));
}

/**
 * Build the whole view as a detached DOM tree: the saved report when `live` is absent,
 * the live panel (the same view plus its controls) when present.
 */
export function renderReport(report: IReport, live?: ILive): HTMLElement {
  const chart = renderChart(report);
  const root = h(
    'div',
    { className: 'ttm-report' },
    renderHeader(report, live),
    live && renderActions(report, live),
    ...renderFindings(report, live),
    ...renderTogether(report),
    chart && h('section', { className: 'ttm-section' }, h('h4', { text: 'Before / after' }), chart),
    renderCodeChanges(report, live ? live.state.codeOpen : true, live ? open => live.actions.showCode(open) : undefined),
    renderNotApplicable(report),
    renderOwnFailures(report),
    renderWarnings(report)
  );
  if (isMeasuring(report)) {
    root.classList.add('ttm-measuring');
  }
  return root;
}
