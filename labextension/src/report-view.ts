/** The static report view: header, findings table, chart, code changes and notes. */

import { renderChart } from './chart';
import { renderCodeChanges } from './code-changes';
import { h } from './dom';
import { formatBytes, formatFactor, formatMemoryChange, formatSeconds, formatTiming } from './format';
import { IFinding, IReport, IVariant, soloVariant, variantLabel } from './report';
import { flopsBreakdown, throughputBadge, throughputItems } from './throughput';

/** Speedups closer to 1 than this are reported as "no measurable change". */
const NOISE_BAND = 0.02;

const NOISY_TITLE = 'IQR above 10% of the median: treat this figure with caution';

function badge(text: string, className: string, title?: string): HTMLElement {
  return h('span', { className: `ttm-badge ${className}`, text, title });
}

function noisyBadge(): HTMLElement {
  return badge('noisy', 'ttm-badge-noisy', NOISY_TITLE);
}

function renderHeader(report: IReport): HTMLElement {
  const env = report.environment;
  const base = report.baseline;
  const threads = env.torch_threads !== undefined ? `, ${env.torch_threads} torch threads` : '';
  const items: [string, string | Node[], string?][] = [
    ['Device', `${env.device_name} (${env.device}, ${env.cpu_count} CPUs${threads})`],
    ['PyTorch', env.torch],
    [
      'Baseline',
      [
        document.createTextNode(`${formatTiming(base.median_s, base.iqr_s)} (median ± IQR)`),
        ...(base.noisy ? [noisyBadge()] : [])
      ]
    ],
    ['Runs', String(base.runs)],
    ['Peak memory', formatBytes(base.peak_memory_bytes), env.memory_measure],
    ...throughputItems(report)
  ];
  if (report.elapsed_s !== null && report.elapsed_s !== undefined) {
    const budget = report.budget_s ? ` of a ${formatSeconds(report.budget_s)} budget` : '';
    items.push(['Measured in', `${formatSeconds(report.elapsed_s)}${budget}`]);
  }
  const list = h('dl', { className: 'ttm-summary' });
  for (const [term, value, title] of items) {
    list.appendChild(h('dt', { text: term }));
    const dd = h('dd', { title });
    if (typeof value === 'string') {
      dd.textContent = value;
    } else {
      value.forEach(node => dd.appendChild(node));
    }
    list.appendChild(dd);
  }
  return h(
    'header',
    { className: 'ttm-header' },
    h('h3', { text: '%%perfcheck report' }),
    list,
    flopsBreakdown(report)
  );
}

function speedupCell(report: IReport, finding: IFinding, variant: IVariant | undefined): HTMLElement {
  const cell = h('td', { className: 'ttm-speedup' });
  if (variant === undefined) {
    cell.textContent = finding.fixable ? 'not measured' : 'not auto-fixable';
    cell.classList.add('ttm-muted');
    return cell;
  }
  if (variant.error !== null) {
    cell.classList.add('ttm-error');
    cell.textContent = `could not run: ${variant.error}`;
    return cell;
  }
  if (variant.speedup === null) {
    cell.textContent = '—';
    return cell;
  }
  if (variant.speedup < 1) {
    cell.classList.add('ttm-slower');
    cell.textContent = `${formatFactor(variant.speedup)} — measured slower here — not recommended`;
  } else if (variant.speedup < 1 + NOISE_BAND) {
    cell.textContent = `${formatFactor(variant.speedup)} — no measurable change`;
  } else {
    cell.classList.add('ttm-faster');
    cell.textContent = `${formatFactor(variant.speedup)} faster`;
  }
  if (variant.noisy) {
    cell.appendChild(noisyBadge());
  }
  const throughput = throughputBadge(variant, report);
  if (throughput) {
    cell.appendChild(h('div', { className: 'ttm-throughput' }, throughput));
  }
  if (variant.one_time_s !== null) {
    const payback =
      variant.break_even_runs !== null && variant.break_even_runs !== undefined
        ? `, paid back after ${variant.break_even_runs} runs`
        : '';
    cell.appendChild(h('div', { className: 'ttm-note', text: `one-time cost ${formatSeconds(variant.one_time_s)}${payback}` }));
  }
  return cell;
}

function numericsCell(variant: IVariant | undefined): HTMLElement {
  if (variant === undefined || variant.error !== null) {
    return h('td', { className: 'ttm-muted', text: '—' });
  }
  const { verdict, max_rel_diff, detail } = variant.numerics;
  const parts = [max_rel_diff !== null ? `max relative difference ${max_rel_diff.toExponential(2)}` : '', detail ?? ''];
  const title = parts.filter(Boolean).join('; ') || undefined;
  return h('td', {}, badge(verdict, `ttm-verdict-${verdict}`, title));
}

function renderFindings(report: IReport): HTMLElement {
  const head = h(
    'thead',
    {},
    h('tr', {}, ...['Finding', 'Evidence', 'Where', 'Speedup (fix alone)', 'Memory', 'Results'].map(t => h('th', { text: t })))
  );
  const body = h('tbody');
  const applied = new Set(report.applied ?? []);
  for (const finding of report.findings) {
    const variant = soloVariant(report, finding.id);
    const memory =
      variant && variant.error === null
        ? formatMemoryChange(report.baseline.peak_memory_bytes, variant.peak_memory_bytes)
        : '—';
    body.appendChild(
      h(
        'tr',
        { attrs: { 'data-finding': finding.id } },
        h(
          'td',
          { className: 'ttm-finding' },
          h('code', { className: 'ttm-finding-id', text: finding.id }),
          applied.has(finding.id) &&
            badge('applied', 'ttm-badge-applied', 'This fix was left applied to the live objects'),
          h('div', { className: 'ttm-finding-title', text: finding.title }),
          finding.guide && h('div', { className: 'ttm-note', text: `Guide: ${finding.guide}` }),
          finding.caveat ? h('div', { className: 'ttm-note ttm-caveat', text: `Caveat: ${finding.caveat}` }) : null
        ),
        h('td', { text: finding.evidence }),
        h('td', { text: finding.where }),
        speedupCell(report, finding, variant),
        h('td', { text: memory }),
        numericsCell(variant)
      )
    );
  }
  const section = h('section', { className: 'ttm-section' }, h('h4', { text: `Findings (${report.findings.length})` }));
  if (report.findings.length === 0) {
    section.appendChild(h('p', { text: 'Nothing in the tuning guide applies to what this cell did.' }));
    return section;
  }
  section.appendChild(h('table', { className: 'ttm-findings' }, head, body));
  const combined = report.variants.find(v => v.fixes.length > 1);
  if (combined && combined.error === null && combined.speedup !== null) {
    const text = `${variantLabel(report, combined)} together: ${formatFactor(combined.speedup)}${combined.speedup < 1 ? ' — measured slower here — not recommended' : ''}`;
    section.appendChild(h('p', { className: 'ttm-combined', text }, throughputBadge(combined, report)));
  }
  return section;
}

function renderList(title: string, className: string, items: (string | Node)[]): HTMLElement | null {
  if (items.length === 0) {
    return null;
  }
  return h(
    'section',
    { className: `ttm-section ${className}` },
    h('h4', { text: title }),
    h('ul', {}, ...items.map(item => h('li', {}, item)))
  );
}

/** Build the whole report as a detached DOM tree. */
export function renderReport(report: IReport): HTMLElement {
  const chart = renderChart(report);
  return h(
    'div',
    { className: 'ttm-report' },
    renderHeader(report),
    renderFindings(report),
    chart && h('section', { className: 'ttm-section' }, h('h4', { text: 'Before / after' }), chart),
    renderCodeChanges(report.findings),
    renderList(
      'Not applicable here',
      'ttm-not-applicable',
      (report.not_applicable ?? []).map(na => h('span', {}, h('code', { text: na.id }), `: ${na.reason}`))
    ),
    renderList('Warnings', 'ttm-warnings', report.warnings ?? [])
  );
}
