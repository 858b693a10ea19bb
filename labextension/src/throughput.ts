/**
 * Compute throughput in the report view: FLOPs per run, achieved TFLOP/s and the share
 * of the device's peak. Every field is optional, so a report without them renders as before.
 */

import { h } from './dom';
import { formatFlops, formatPeak, formatRate, formatShareOfPeak } from './format';
import { IEnvironment, IReport, IThroughput } from './report';

const FLOPS_TITLE = 'Model FLOPs of one run (torch.utils.flop_counter.FlopCounterMode)';

function isNumber(value: unknown): value is number {
  return typeof value === 'number' && Number.isFinite(value);
}

/** Where the peak comes from, plus the per-precision table when there is one. */
export function peakSource(env: IEnvironment): string | undefined {
  const parts: string[] = [];
  if (typeof env.peak_tflops_source === 'string' && env.peak_tflops_source) {
    parts.push(env.peak_tflops_source);
  }
  const peaks = env.peak_tflops;
  if (peaks && typeof peaks === 'object') {
    const columns = Object.entries(peaks).filter(([, value]) => isNumber(value));
    if (columns.length > 0) {
      parts.push(columns.map(([name, value]) => `${name} ${formatPeak(value)}`).join(', '));
    }
  }
  return parts.length > 0 ? parts.join(' — ') : undefined;
}

/** "36.1% of peak (68.2 TFLOP/s)", or "no peak known". */
function shareText(item: IThroughput): string {
  const share = formatShareOfPeak(item.utilisation);
  return isNumber(item.utilisation) && isNumber(item.peak_tflops) && item.peak_tflops > 0
    ? `${share} (${formatPeak(item.peak_tflops)})`
    : share;
}

/** The tooltip of a throughput: the effective peak and where it comes from. */
function shareTitle(item: IThroughput, source: string | undefined): string | undefined {
  const parts = [shareText(item), source].filter(Boolean);
  return parts.join('; ') || undefined;
}

/** "184 TFLOP/s · 18.6% of peak" for a measured configuration, or null without FLOPs. */
export function throughputBadge(item: IThroughput, report: IReport): HTMLElement | null {
  if (!isNumber(item.achieved_tflops)) {
    return null;
  }
  const known = isNumber(item.utilisation);
  return h('span', {
    className: `ttm-badge ttm-badge-throughput${known ? '' : ' ttm-badge-no-peak'}`,
    text: `${formatRate(item.achieved_tflops)} · ${formatShareOfPeak(item.utilisation)}`,
    title: shareTitle(item, peakSource(report.environment))
  });
}

/** Rows for the header list: [term, value, tooltip]. Empty for a report without them. */
export function throughputItems(report: IReport): [string, string, string?][] {
  const base = report.baseline;
  const items: [string, string, string?][] = [];
  if (isNumber(base.flops)) {
    items.push(['FLOPs per run', formatFlops(base.flops), FLOPS_TITLE]);
  } else if (typeof base.flops_detail === 'string' && base.flops_detail) {
    items.push(['FLOPs per run', base.flops_detail]);
  }
  if (isNumber(base.achieved_tflops)) {
    items.push(['Achieved', formatRate(base.achieved_tflops), 'Model FLOPs of one run / median time']);
    items.push(['Share of peak', shareText(base), peakSource(report.environment)]);
  }
  return items;
}

/** The baseline's FLOPs by "dtype kind" in a collapsed list, largest first. */
export function flopsBreakdown(report: IReport): HTMLElement | null {
  const breakdown = report.baseline.flops_breakdown;
  if (!breakdown || typeof breakdown !== 'object') {
    return null;
  }
  const entries = Object.entries(breakdown)
    .filter(([, value]) => isNumber(value))
    .sort(([, a], [, b]) => b - a);
  if (entries.length === 0) {
    return null;
  }
  const total = entries.reduce((sum, [, value]) => sum + value, 0);
  return h(
    'details',
    { className: 'ttm-flops-breakdown' },
    h('summary', { text: 'FLOPs by precision and kind' }),
    h(
      'ul',
      {},
      ...entries.map(([bucket, value]) =>
        h(
          'li',
          { attrs: { 'data-bucket': bucket } },
          h('code', { text: bucket }),
          `: ${formatFlops(value)}${total > 0 ? ` (${((100 * value) / total).toFixed(1)}%)` : ''}`
        )
      )
    )
  );
}
