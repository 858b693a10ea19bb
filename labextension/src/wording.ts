/**
 * What the view says, in words: the TypeScript side of `torchtune_magic/render/summary.py`
 * (the text and static HTML fallbacks say the same things from there). Pure strings.
 */

import { formatBytes, formatExponent, formatFactor, formatGeneral, formatSeconds } from './format';
import {
  INotApplicable,
  INumerics,
  IOwnFailure,
  IReport,
  Segment,
  IVariant,
  isMeasuring,
  isRecommendedSet,
  isSlower,
  isWin,
  latestVariants
} from './report';

export const MEASURING = 'measuring…';
export const SLOWER = 'measured slower here — not recommended';
export const NO_CLEAR_CHANGE = 'no clear change';
export const PROVISIONAL = 'so far (still measuring)';
export const NOT_COMPARED = 'results not compared yet';
/** Other processes' busy CPUs worth a line in the report (summary.BUSY_CPUS). */
const BUSY_CPUS = 0.25;
/** ... over a measuring window at least this long (summary.LOAD_WINDOW_MIN_S). */
const LOAD_WINDOW_MIN_S = 0.5;
export const FITS = 'fits with this fix: it ran past where the cell ran out of memory';
export const OWN_FAILURES = "perfcheck's own failures (your cell ran as it would without perfcheck)";

/** One perfcheck failure in a line: which part, and why (the traceback folds away). */
export function ownFailureLine(failure: IOwnFailure): string {
  return `${failure.part} failed: ${failure.reason}; the rest of this report stands`;
}

/** Good, bad or neither: the colour a figure is shown in. */
export type Tone = 'good' | 'bad' | 'neutral' | 'pending';

export interface IWorded {
  text: string;
  tone: Tone;
  title?: string;
}

/** "1 run", "2 runs" (and any other count and noun). */
export function count(n: number, noun: string, nouns = `${noun}s`): string {
  return `${n} ${n === 1 ? noun : nouns}`;
}

/** `batches`, `optimizer steps`, `forwards` (summary.plural). */
export function plural(unit: string): string {
  return /(ch|sh|s|x)$/.test(unit) ? `${unit}es` : `${unit}s`;
}

/** " per batch" when runs were sampled (times are then per step), else "". */
export function perStep(report: IReport): string {
  return report.sampling ? ` per ${report.sampling.unit}` : '';
}

/** `14:02` in the reader's time zone, from an ISO 8601 time; "" when there is none. */
export function clock(iso: string | null | undefined): string {
  if (!iso) {
    return '';
  }
  const when = new Date(iso);
  if (Number.isNaN(when.getTime())) {
    return '';
  }
  const pad = (n: number) => String(n).padStart(2, '0');
  return `${pad(when.getHours())}:${pad(when.getMinutes())}`;
}

/** `6.8× less peak memory for 5% more time`: a memory fix judged by memory (--memory). */
function memoryFirst(report: IReport, variant: IVariant): string {
  const speedup = variant.speedup as number;
  const change = 1 / speedup - 1;
  const cost = `${Math.round(Math.abs(change) * 100)}% ${change >= 0 ? 'more' : 'less'} time`;
  const before = report.baseline.peak_memory_bytes;
  const after = variant.peak_memory_bytes;
  if (!before || !after) {
    return `peak memory not measured; ${cost}`;
  }
  const ratio = before / after;
  const less = ratio >= 1 ? `${ratio.toFixed(1)}× less` : `${(1 / ratio).toFixed(1)}× more`;
  return `${less} peak memory for ${cost}`;
}

/** ` (1.41×–1.66× over 9 rounds)`: the speedup's interval over paired rounds (summary.interval). */
export function interval(variant: IVariant): string {
  if (variant.rounds === null || variant.rounds === undefined) {
    return '';
  }
  const rounds = count(variant.rounds, 'round');
  const low = variant.speedup_low;
  const high = variant.speedup_high;
  if (low === null || low === undefined || high === null || high === undefined) {
    return ` (${rounds}: too few for an interval)`;
  }
  return ` (${formatFactor(low)}–${formatFactor(high)} over ${rounds})`;
}

/** `not enough time to tell; --budget 60 would`, or "" (summary.not_enough_time). */
export function notEnoughTime(variant: IVariant): string {
  const wanted = variant.budget_to_tell_s;
  if (!wanted) {
    return '';
  }
  return `not enough time to tell; \`--budget ${Math.round(wanted)}\` would`;
}

/** Why a fix was not timed: its evidence cannot reach the no-change band (summary.too_small). */
export function tooSmall(atMost: number): string {
  return `too small to matter here: its evidence allows at most ${((atMost - 1) * 100).toFixed(1)}% (not timed)`;
}

/**
 * What a fix measured: `1.54× faster (1.41×–1.66× over 9 rounds)`, `0.87× (…) — measured
 * slower here — not recommended` (only when the whole interval is below 1), `1.01× (…) — no
 * clear change`, `1.3× so far (still measuring)` while measuring, `failed: …`, `measuring…`,
 * `not measured: not enough time to tell; …` or `not measured`.
 */
export function speedup(report: IReport, variant: IVariant | undefined): IWorded {
  if (variant?.fits) {
    return { text: FITS, tone: 'good' };
  }
  if (variant !== undefined && variant.at_most != null && variant.speedup === null) {
    return { text: tooSmall(variant.at_most), tone: 'neutral' };
  }
  if (variant === undefined || (variant.speedup === null && variant.error === null)) {
    if (variant !== undefined && variant.budget_to_tell_s) {
      return { text: `not measured: ${notEnoughTime(variant)}`, tone: 'neutral' };
    }
    return isMeasuring(report)
      ? { text: MEASURING, tone: 'pending' }
      : { text: 'not measured', tone: 'neutral' };
  }
  if (variant.error !== null) {
    return { text: `failed: ${variant.error}`, tone: 'bad' };
  }
  const factor = variant.speedup as number;
  if (variant.judged_by === 'memory') {
    const text = memoryFirst(report, variant);
    const smaller = (variant.peak_memory_bytes ?? Infinity) < (report.baseline.peak_memory_bytes ?? 0);
    return { text, tone: smaller ? 'good' : 'bad' };
  }
  const unit = variant.judged_by === 'whole cell' ? ' (whole cell)' : perStep(report);
  const base = `${formatFactor(factor)}${unit}`;
  if (isMeasuring(report)) {
    return { text: `${base} ${PROVISIONAL}`, tone: 'pending' };
  }
  const spread = interval(variant);
  const short = notEnoughTime(variant);
  const tail = short ? `; ${short}` : '';
  if (isSlower(variant)) {
    return { text: `${base}${spread} — ${SLOWER}${tail}`, tone: 'bad' };
  }
  if (!isWin(variant)) {
    // unsettled: no verdict yet, only what would give one
    return { text: `${base}${spread} — ${short || NO_CLEAR_CHANGE}`, tone: 'neutral' };
  }
  return { text: `${formatFactor(factor)} faster${perStep(report)}${spread}`, tone: 'good' };
}

/** `recommended fixes together (a, b)` or `fixes together (a, b)` (summary.combined_label). */
export function combinedLabel(report: IReport, variant: IVariant): string {
  const which = isRecommendedSet(report, variant.fixes) ? 'recommended fixes' : 'fixes';
  return `${which} together (${variant.fixes.join(', ')})`;
}

/** What the notebook edits carry: the fixes applied, else the recommended ones (summary.edits_scope). */
export function editsScope(report: IReport): string {
  const applied = report.applied ?? [];
  if (applied.length > 0) {
    return `the fixes applied (${applied.join(', ')})`;
  }
  const fixes = report.notebook_edits?.fixes ?? [];
  return fixes.length > 0 ? `the recommended fixes (${fixes.join(', ')})` : 'the recommended fixes';
}

/** Other processes' share of the kernel's CPUs while it measured (summary.load_line), or "". */
export function load(report: IReport): string {
  const l = report.load;
  if (!l || l.window_s < LOAD_WINDOW_MIN_S) {
    return '';
  }
  const busy = l.other_cpu_s / l.window_s;
  if (busy < BUSY_CPUS) {
    return '';
  }
  return (
    `other processes kept ${busy.toFixed(2)} of this kernel's ${l.cpus} CPUs busy ` +
    `while it measured (${l.other_cpu_s.toFixed(1)} CPU-s in ${l.window_s.toFixed(1)} s)`
  );
}

/** The torchrun job and each rank's own baseline (summary.distributed_line), or "". */
export function distributed(report: IReport): string {
  const job = report.distributed;
  if (!job) {
    return '';
  }
  const nodes = `${job.nodes} node${job.nodes === 1 ? '' : 's'}`;
  const line = `torchrun: ${job.world_size} ranks (${job.backend}, ${nodes}), times are the slowest rank's`;
  const own = job.ranks
    .filter(r => r.baseline_s !== null)
    .map(r => {
      const share = r.collective_share;
      const waited = share === null || share === undefined ? '' : ` (${Math.round(share * 100)}% in all-reduce)`;
      return `rank ${r.rank} (${r.host}) ${formatSeconds(r.baseline_s)}${waited}`;
    });
  return own.length > 0 ? `${line}; each rank's own baseline${perStep(report)}: ${own.join(', ')}` : line;
}

/** `whole cell 61.2 s → 27.0 s (projected)` for a sampled measurement, or "". */
export function projected(report: IReport, variant: IVariant): string {
  const before = report.baseline.projected_cell_s;
  const after = variant.projected_cell_s;
  if (before === null || before === undefined || after === null || after === undefined || measuredBefore(report, variant)) {
    return ''; // a number from an earlier round has no projection against this baseline
  }
  return `whole cell ${formatSeconds(before)} → ${formatSeconds(after)} (projected)`;
}

/** `13.8 s one-time (compile), pays back after 92 runs`, or "". */
export function oneTime(variant: IVariant): string {
  if (variant.one_time_s === null || variant.one_time_s === undefined) {
    return '';
  }
  const cause = variant.one_time_cause || 'compile, worker start';
  let text = `${formatSeconds(variant.one_time_s)} one-time (${cause})`;
  if (variant.break_even_runs !== null && variant.break_even_runs !== undefined) {
    text += `, pays back after ${count(variant.break_even_runs, 'run')}`;
  }
  return text;
}

/** Peak memory moved by less than this share reads "same memory". */
const MEMORY_SAME = 0.01;

/** `−76% memory` (good) or `+28% memory` (bad), the bytes in the title; null if unknown. */
export function memory(report: IReport, variant: IVariant | undefined): IWorded | null {
  if (variant === undefined || variant.error !== null || variant.peak_memory_bytes === null) {
    return null;
  }
  const base = report.baseline.peak_memory_bytes;
  if (!base) {
    return { text: `${formatBytes(variant.peak_memory_bytes)} peak`, tone: 'neutral' };
  }
  const change = variant.peak_memory_bytes / base - 1;
  const title = `peak memory ${formatBytes(base)} → ${formatBytes(variant.peak_memory_bytes)}`;
  if (Math.abs(change) < MEMORY_SAME) {
    return { text: 'same memory', tone: 'neutral', title };
  }
  const percent = Math.round(Math.abs(change) * 100);
  return change < 0
    ? { text: `−${percent}% memory`, tone: 'good', title }
    : { text: `+${percent}% memory`, tone: 'bad', title };
}

/** 0.001 → `0.1 %`, 0.016 → `1.6 %` (summary._percent). */
function percent(share: number): string {
  return `${formatGeneral(share * 100, 2)} %`;
}

/** A curve's last loss, `2.301` (summary._final). */
function finalLoss(curve: (number | null)[] | null | undefined): string {
  const value = curve && curve.length > 0 ? curve[curve.length - 1] : null;
  return value === null ? 'not finite' : formatGeneral(value, 4);
}

/**
 * A training cell's loss curve against the baseline's (summary.loss): `same loss: within
 * 0.1 % of the baseline's over 28 steps (max rel diff 3.27e-07); final 2.301 → 2.301`,
 * `loss changed: up to 4.2 % off the baseline's over 28 steps (tolerance 1.6 %); final
 * 2.301 → 2.401`, or null where no loss was compared.
 */
export function loss(variant: IVariant | undefined): IWorded | null {
  const n = variant?.numerics;
  if (variant === undefined || variant.error !== null || !n || !n.loss_verdict) {
    return null;
  }
  const steps = `over ${n.loss_steps} step${n.loss_steps === 1 ? '' : 's'}`;
  const first = finalLoss(n.loss_baseline);
  const last = finalLoss(n.loss_fix);
  const diff = n.loss_max_rel_diff ?? null;
  const tolerance = percent(n.loss_tolerance ?? 0);
  if (n.loss_verdict !== 'same loss') {
    // NaN or inf at a step where the other curve is finite: no difference to give
    const off =
      diff !== null
        ? `up to ${percent(diff)} off the baseline's`
        : "not finite where the baseline's is, or finite where it is not,";
    return { text: `${n.loss_verdict}: ${off} ${steps} (tolerance ${tolerance}); final ${first} → ${last}`, tone: 'bad' };
  }
  if (!diff) {
    return { text: `${n.loss_verdict}: identical ${steps}; final ${first}`, tone: 'neutral' };
  }
  return {
    text: `${n.loss_verdict}: within ${tolerance} of the baseline's ${steps} (max rel diff ${formatExponent(diff, 2)}); final ${first} → ${last}`,
    tone: 'neutral'
  };
}

/** Whether the two loss curves are worth drawing: compared, and not bit-identical (summary.loss_curves_differ). */
export function lossCurvesDiffer(variant: IVariant | undefined): boolean {
  const n = variant?.numerics;
  return (
    variant !== undefined &&
    variant.error === null &&
    !!n &&
    n.loss_max_rel_diff !== 0 &&
    !!n.loss_baseline?.length &&
    !!n.loss_fix?.length
  );
}

/** Earlier measurements of a fix set: `earlier: 1.80× at 14:02, 1.62× at 14:10`. */
export function earlier(variants: IVariant[]): string {
  const parts = variants.map(v => {
    const at = clock(v.measured_at);
    const factor = v.error !== null ? 'failed' : formatFactor(v.speedup as number);
    return at ? `${factor} at ${at}` : factor;
  });
  return parts.length > 0 ? `earlier: ${parts.join(', ')}` : '';
}

/** `measured at 14:02, before the latest baseline` for a number from an earlier round. */
export function measuredBefore(report: IReport, variant: IVariant): string {
  const at = variant.measured_at;
  const base = report.baseline.measured_at;
  if (!at || !base || at >= base) {
    return '';
  }
  return `measured at ${clock(at)}, before the latest baseline`;
}

/** The baseline's timing: `412 ms ± 11.0 ms per batch over 9 runs`, or why there is none. */
export function baseline(report: IReport): string {
  const b = report.baseline;
  if (b.median_s === null) {
    return isMeasuring(report) ? MEASURING : 'not measured';
  }
  return `${baselineTime(report)} over ${count(b.runs, 'run')}`;
}

/** The baseline's median with its IQR (`412 ms ± 11.0 ms per batch (median ± IQR)`); one run
 * has no spread to show (`412 ms per batch (one run)`). */
export function baselineTime(report: IReport): string {
  const b = report.baseline;
  if (b.median_s === null) {
    return baseline(report);
  }
  if (b.runs <= 1 || b.iqr_s === null) {
    return `${formatSeconds(b.median_s)}${perStep(report)}${b.runs === 1 ? ' (one run)' : ''}`;
  }
  return `${formatSeconds(b.median_s)} ± ${formatSeconds(b.iqr_s)}${perStep(report)} (median ± IQR)`;
}

/** How a long cell was sampled (summary.sampling_line), or "". */
export function sampling(report: IReport): string {
  const s = report.sampling;
  if (!s) {
    return '';
  }
  const of = s.steps_per_run ? ` of ${s.steps_per_run}` : '';
  const detail = s.steps_detail ? ` (${s.steps_detail})` : '';
  const last = s.warmup_steps + s.steps_timed;
  const first = s.warmup_steps + 1;
  const cut = s.epoch_end_step
    ? ` (each run's first epoch ended after ${s.unit} ${s.epoch_end_step} to hold one)`
    : '';
  const restart = s.steps_per_epoch
    ? `; an epoch restart in the timed ${plural(s.unit)} counts once per ` +
      `${s.steps_per_epoch}${cut}`
    : '';
  return (
    `sampled: every measuring run stopped after ${s.unit} ${last}${of}${detail}, ` +
    (s.warmup_steps > 0
      ? `${plural(s.unit)} ${first}–${last} timed after ${s.warmup_steps} warm-up`
      : `the first epoch timed whole`) +
    `${restart}; times are per ${s.unit}, the whole cell projected`
  );
}

/** What became of the cell's one complete run (summary.cell_run_line), or "". */
export function cellRun(report: IReport): string {
  const run = report.cell_run;
  if (!run || report.oom) {
    return '';
  }
  const unit = report.sampling ? report.sampling.unit : 'step';
  const fixes = run.fixes ?? [];
  const withFixes = fixes.length > 0 ? `, with ${fixes.join(', ')}` : '';
  switch (run.status) {
    case 'probe':
      return 'the cell ran once, complete, in the probe: the kernel is as after that run';
    case 'running':
      return `finishing the cell: its one complete run${withFixes}…`;
    case 'skipped':
      return "--no-finish: the cell's complete run was skipped; the kernel is as before the cell";
    default:
      break;
  }
  const parts: string[] = [];
  if (run.seconds !== null && run.seconds !== undefined) {
    parts.push(formatSeconds(run.seconds));
  }
  if (run.steps !== null && run.steps !== undefined) {
    parts.push(run.steps === 1 ? `1 ${unit}` : `${run.steps} ${plural(unit)}`);
  }
  const took = parts.join(', ');
  if (run.status === 'complete') {
    return `the cell's complete run: ${took}${withFixes}`;
  }
  if (run.status === 'interrupted') {
    return `the cell's complete run was interrupted (Ctrl-C) after ${took}${withFixes}`;
  }
  return `the cell's complete run failed after ${took}${withFixes}: ${run.detail ?? ''}`;
}

/** The report's phase in words (summary.phase_line), or "" when done. */
export function phase(report: IReport): string {
  if (report.phase === 'measuring') {
    return 'measuring… numbers fill in as each configuration is measured';
  }
  if (report.phase === 'interrupted') {
    return 'interrupted (Ctrl-C) before every number was in';
  }
  if (report.phase === 'finishing') {
    return "every number is in; the cell's complete run is under way";
  }
  return '';
}

/** The out-of-memory summary (summary.oom_line), or "". */
export function oom(report: IReport): string {
  const o = report.oom;
  if (!o) {
    return '';
  }
  const where = o.line ? ` at cell line ${o.line}` : '';
  const asked = o.requested_bytes ? `, asking for ${formatBytes(o.requested_bytes)}` : '';
  const inUse = o.in_use_bytes ? ` with ${formatBytes(o.in_use_bytes)} in use (${o.in_use_measure})` : '';
  return (
    `the cell ran out of memory${where}${asked}${inUse}: ${o.error.replace(/\.+$/, '')}. Nothing was timed ` +
    'against a baseline; the findings below come from the run up to the failure, memory ' +
    `fixes first${fitOutcome(report)}`
  );
}

/** What the runs with memory fixes showed after an out-of-memory probe (summary._fit_outcome). */
function fitOutcome(report: IReport): string {
  const tried = latestVariants(report).filter(v => v.fits !== null && v.fits !== undefined);
  const fitting = tried.filter(v => v.fits);
  if (fitting.length > 0) {
    const runs = fitting.map(
      v => v.fixes.join(' + ') + (v.peak_memory_bytes ? ` (${formatBytes(v.peak_memory_bytes)} peak)` : '')
    );
    return `; it fits with ${runs.join(', or with ')}`;
  }
  return tried.length > 0 ? '; with each memory fix tried it ran out of memory again' : '';
}

/** The parts of a run's time split, in order, as a user reads them (summary.SPLIT_PARTS). */
export const SPLIT_PARTS: [string, string][] = [
  ['data_wait', 'data wait'],
  ['forward', 'forward'],
  ['backward', 'backward'],
  ['optimizer', 'optimizer'],
  ['host_sync', 'host syncs'],
  ['other', 'other']
];

/** [key, name, share] of each part with at least half a percent (summary.split_shares). */
export function splitShares(report: IReport): [string, string, number][] {
  const split = report.time_split;
  if (!split) {
    return [];
  }
  const total = Object.values(split).reduce((sum, value) => sum + value, 0);
  if (!(total > 0)) {
    return [];
  }
  return SPLIT_PARTS.map(
    ([key, name]): [string, string, number] => [key, name, (split[key] ?? 0) / total]
  ).filter(([, , share]) => share >= 0.005);
}

/** `where the time went (…): data wait 63% · forward 14% · …` (summary.split_line). */
export function splitLine(report: IReport): string {
  const shares = splitShares(report);
  if (shares.length === 0) {
    return '';
  }
  const parts = shares.map(([, name, share]) => `${name} ${Math.round(share * 100)}%`);
  return `where the time went (the baseline's first run): ${parts.join(' · ')}`;
}

/**
 * The part of the time split a finding's fix acts on, as its chip reads (`data wait 63%`,
 * the name alone where the report has no split), with a title saying what it is.
 */
export function segment(report: IReport, part: Segment): IWorded {
  const name = SPLIT_PARTS.find(([key]) => key === part)?.[1] ?? part.replace('_', ' ');
  const split = report.time_split;
  const total = split ? Object.values(split).reduce((sum, value) => sum + value, 0) : 0;
  if (!split || !(total > 0)) {
    return { text: name, tone: 'neutral', title: `this fix acts on the ${name}` };
  }
  const share = (split[part] ?? 0) / total;
  const percent = share > 0 && share < 0.005 ? '<1%' : `${Math.round(share * 100)}%`;
  return {
    text: `${name} ${percent}`,
    tone: 'neutral',
    title: `this fix acts on the ${name}: ${percent} of the time in the baseline's first run`
  };
}

/**
 * Whether a fix left the cell's results the same, in plain words (summary.numerics):
 * `identical`, `close`, `changed`, `results not compared` (why, in the badge's title) or
 * `results not compared yet`.
 */
export function results(numerics: INumerics): string {
  if (numerics.verdict !== 'not-compared') {
    return numerics.verdict;
  }
  return numerics.detail ? 'results not compared' : NOT_COMPARED;
}

/** The not-applicable checks, those with one reason together, in first-seen order (summary.by_reason). */
export function byReason(items: INotApplicable[]): [string[], string][] {
  const grouped = new Map<string, string[]>();
  for (const item of items) {
    grouped.set(item.reason, [...(grouped.get(item.reason) ?? []), item.id]);
  }
  return Array.from(grouped, ([reason, ids]): [string[], string] => [ids, reason]);
}
