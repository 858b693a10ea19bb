/**
 * The before/after bar chart: baseline vs each variant's median time, and peak
 * memory for the variants where it changed. Built as SVG through DOM APIs.
 */

import { s } from './dom';
import { formatBytes, formatSeconds } from './format';
import { IReport, IVariant, isCurrent, isSlower, isWin, latestVariants, variantLabel } from './report';
import { memory } from './wording';

type BarKind = 'baseline' | 'better' | 'worse' | 'same';

interface IBar {
  label: string;
  value: number;
  kind: BarKind;
}

const WIDTH = 660;
const LABEL_WIDTH = 210;
const VALUE_WIDTH = 80;
const BAR_HEIGHT = 16;
const ROW_HEIGHT = 22;
const TITLE_HEIGHT = 24;
const GROUP_GAP = 12;
// labels are right-aligned before the bars: at 12px this many characters fit the width
const MAX_LABEL_CHARS = 30;

/** A memory bar's colour is its badge's verdict: less memory good, more bad, else neutral. */
function memoryKind(report: IReport, variant: IVariant): BarKind {
  const tone = memory(report, variant)?.tone;
  return tone === 'good' ? 'better' : tone === 'bad' ? 'worse' : 'same';
}

/** A bar's colour follows the verdict of its paired rounds, not which bar is shorter. */
function kindOf(variant: IVariant): BarKind {
  if (isWin(variant)) {
    return 'better';
  }
  return isSlower(variant) ? 'worse' : 'same';
}

function shorten(label: string): string {
  return label.length > MAX_LABEL_CHARS ? `${label.slice(0, MAX_LABEL_CHARS - 1)}…` : label;
}

function timeBars(report: IReport): IBar[] {
  const baseline = report.baseline.median_s;
  if (baseline === null) {
    return [];
  }
  const bars: IBar[] = [{ label: 'baseline', value: baseline, kind: 'baseline' }];
  // only bars measured against this baseline: one from an earlier round stood against
  // another baseline's runs
  for (const variant of latestVariants(report).filter(v => isCurrent(report, v))) {
    if (variant.error === null && variant.median_s !== null) {
      bars.push({ label: variantLabel(report, variant), value: variant.median_s, kind: kindOf(variant) });
    }
  }
  return bars;
}

function memoryBars(report: IReport): IBar[] {
  const baseline = report.baseline.peak_memory_bytes;
  if (baseline === null) {
    return [];
  }
  const changed = latestVariants(report).filter(
    v => isCurrent(report, v) && v.error === null && v.peak_memory_bytes !== null && v.peak_memory_bytes !== baseline
  );
  if (changed.length === 0) {
    return [];
  }
  return [
    { label: 'baseline', value: baseline, kind: 'baseline' },
    ...changed.map(v => ({
      label: variantLabel(report, v),
      value: v.peak_memory_bytes as number,
      kind: memoryKind(report, v)
    }))
  ];
}

function group(
  title: string,
  bars: IBar[],
  format: (value: number) => string,
  top: number
): { node: SVGGElement; height: number } {
  const node = s('g', { className: 'ttm-chart-group', attrs: { transform: `translate(0, ${top})` } });
  node.appendChild(
    s('text', { className: 'ttm-chart-title', text: title, attrs: { x: '0', y: '14' } })
  );
  const scale = Math.max(...bars.map(b => b.value)) || 1;
  const barSpace = WIDTH - LABEL_WIDTH - VALUE_WIDTH;
  bars.forEach((bar, index) => {
    const y = TITLE_HEIGHT + index * ROW_HEIGHT;
    const width = Math.max(1, (bar.value / scale) * barSpace);
    const tooltip = `${bar.label}: ${format(bar.value)}`;
    node.appendChild(
      s(
        'g',
        { className: `ttm-chart-row ttm-bar-${bar.kind}`, title: tooltip },
        s('text', {
          className: 'ttm-chart-label',
          text: shorten(bar.label),
          attrs: { x: String(LABEL_WIDTH - 8), y: String(y + BAR_HEIGHT - 4), 'text-anchor': 'end' }
        }),
        s('rect', {
          className: 'ttm-chart-bar',
          attrs: {
            x: String(LABEL_WIDTH),
            y: String(y),
            width: width.toFixed(1),
            height: String(BAR_HEIGHT),
            rx: '2'
          }
        }),
        s('text', {
          className: 'ttm-chart-value',
          text: format(bar.value),
          attrs: { x: (LABEL_WIDTH + width + 6).toFixed(1), y: String(y + BAR_HEIGHT - 4) }
        })
      )
    );
  });
  return { node, height: TITLE_HEIGHT + bars.length * ROW_HEIGHT };
}

/** The chart, or null when there is no baseline time to compare against. */
export function renderChart(report: IReport): SVGSVGElement | null {
  const time = timeBars(report);
  if (time.length === 0) {
    return null;
  }
  const svg = s('svg', {
    className: 'ttm-chart',
    attrs: { role: 'img', 'aria-label': 'Before/after: median time per run and peak memory' }
  });
  const unit = report.sampling ? report.sampling.unit : 'run';
  const timeGroup = group(`Median time per ${unit} (shorter is faster)`, time, formatSeconds, 0);
  svg.appendChild(timeGroup.node);
  let height = timeGroup.height;
  const memory = memoryBars(report);
  if (memory.length > 0) {
    const memoryGroup = group('Peak memory (where it changed)', memory, formatBytes, height + GROUP_GAP);
    svg.appendChild(memoryGroup.node);
    height += GROUP_GAP + memoryGroup.height;
  }
  svg.setAttribute('viewBox', `0 0 ${WIDTH} ${height}`);
  svg.setAttribute('width', String(WIDTH));
  svg.setAttribute('height', String(height));
  return svg;
}

const LOSS_WIDTH = 180;
const LOSS_HEIGHT = 48;

/**
 * A small plot of a fix's loss per step (blue) over the baseline's (grey), on one scale,
 * where the two differ (render/html.py draws the same); a point that is not finite is
 * left out. Null where there is nothing to draw.
 */
export function renderLossCurves(variant: IVariant): SVGSVGElement | null {
  const base = variant.numerics.loss_baseline ?? [];
  const fixed = variant.numerics.loss_fix ?? [];
  const values = [...base, ...fixed].filter((v): v is number => v !== null);
  if (values.length === 0) {
    return null;
  }
  const low = Math.min(...values);
  const span = Math.max(...values) - low || 1;
  const last = Math.max(base.length, fixed.length) - 1 || 1;
  const line = (curve: (number | null)[], kind: string) => {
    const points = curve
      .map((v, i) =>
        v === null
          ? null
          : `${((i * LOSS_WIDTH) / last).toFixed(1)},${(LOSS_HEIGHT - 2 - ((v - low) * (LOSS_HEIGHT - 4)) / span).toFixed(1)}`
      )
      .filter(Boolean)
      .join(' ');
    return s('polyline', { className: `ttm-loss-${kind}`, attrs: { points, fill: 'none' } });
  };
  const label = `loss per step: baseline (grey), ${variant.fixes.join('+')} (blue)`;
  const svg = s(
    'svg',
    {
      className: 'ttm-loss-curves',
      title: label,
      attrs: { role: 'img', 'aria-label': label, width: String(LOSS_WIDTH), height: String(LOSS_HEIGHT) }
    },
    line(base, 'baseline'),
    line(fixed, 'fix')
  );
  svg.setAttribute('viewBox', `0 0 ${LOSS_WIDTH} ${LOSS_HEIGHT}`);
  return svg;
}
