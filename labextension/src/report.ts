/**
 * The report produced by `%%perfcheck` (schema `torchtune-magic/report/v1`,
 * see `torchtune_magic/report.schema.json`) and the lookups the view needs.
 *
 * Pure data: no DOM, no JupyterLab, so the same module serves the labextension and the
 * anywidget ES module of the live panel.
 */

export const MIME_TYPE = 'application/vnd.torchtune-magic.report.v1+json';
export const SCHEMA_ID = 'torchtune-magic/report/v1';

/** Speedups in [1, 1 + NO_CHANGE_BAND) read "no clear change" (report.py's band). */
export const NO_CHANGE_BAND = 0.02;

/** A fix's speedup over paired rounds, read from its interval (measuring/verdict.py). */
export type SpeedupVerdict = 'faster' | 'slower' | 'no clear change';

export type Verdict = 'identical' | 'close' | 'changed' | 'not-compared';
export type Phase = 'measuring' | 'finishing' | 'done' | 'interrupted';

export interface IEnvironment {
  torch: string;
  python?: string;
  device: 'cpu' | 'cuda';
  device_name: string;
  cpu_count: number;
  torch_threads?: number;
  memory_measure?: string;
  /** Dense peak TFLOP/s per precision (bf16, fp16, tf32, fp32); null where none is known. */
  peak_tflops?: Record<string, number> | null;
  /** Where `peak_tflops` comes from, or why there is none. */
  peak_tflops_source?: string;
}

/** Compute throughput of one configuration (optional: absent in older reports). */
export interface IThroughput {
  flops?: number | null;
  achieved_tflops?: number | null;
  utilisation?: number | null;
  peak_tflops?: number | null;
}

export interface IStats extends IThroughput {
  median_s: number | null;
  iqr_s: number | null;
  runs: number;
  peak_memory_bytes: number | null;
  noisy?: boolean;
  /** Sampled runs: the whole cell projected from the per-step time. */
  projected_cell_s?: number | null;
  /** When this measurement finished (ISO 8601, UTC). */
  measured_at?: string | null;
}

export interface IBaseline extends IStats {
  flops_breakdown?: Record<string, number> | null;
  flops_detail?: string | null;
}

/** One notebook cell to edit, found by execution count (null: the %%perfcheck cell). */
export interface ICellChange {
  execution_count: number | null;
  before: string;
  after: string;
  diff: string;
}

export interface ICodeChange {
  diff: string;
  elsewhere: string[];
  cells?: ICellChange[];
}

export interface INotebookEdits {
  fixes: string[];
  cells: ICellChange[];
}

/** A part of the time split (`IReport.time_split`): what a finding's fix acts on. */
export type Segment = 'data_wait' | 'forward' | 'backward' | 'optimizer' | 'host_sync' | 'other';

export interface IFinding {
  id: string;
  title: string;
  /** One sentence with the key figure; the rest is in `details`. */
  evidence: string;
  /** What else the check saw (trials, per-batch figures), folded away (optional). */
  details?: string | null;
  /** The part of the time split the fix acts on (optional). */
  segment?: Segment | null;
  where: string;
  fixable: boolean;
  guide: string;
  line?: number | null;
  caveat?: string | null;
  code_change?: ICodeChange | null;
}

export interface INumerics {
  verdict: Verdict;
  max_rel_diff: number | null;
  detail?: string | null;
  /** A training cell: the fix's loss per step against the baseline's (measuring/losses.py). */
  loss_verdict?: 'same loss' | 'loss changed' | null;
  loss_max_rel_diff?: number | null;
  loss_tolerance?: number | null;
  loss_steps?: number | null;
  /** At most 200 points of each curve, spread evenly (null: not finite). */
  loss_baseline?: (number | null)[] | null;
  loss_fix?: (number | null)[] | null;
}

export interface IVariant extends IStats {
  fixes: string[];
  speedup: number | null;
  numerics: INumerics;
  one_time_s: number | null;
  /** What the one-time cost pays for, e.g. "compile", "worker start". */
  one_time_cause?: string | null;
  break_even_runs?: number | null;
  /** "memory": a memory fix under --memory, judged by its peak memory first. */
  judged_by?: 'memory' | 'whole cell' | null;
  /** After an out-of-memory cell: whether one run with this memory fix got past the failure. */
  fits?: boolean | null;
  /** The baseline median this speedup was measured against. */
  baseline_median_s?: number | null;
  /** The speedup's 99.9% interval over paired rounds (null: too few rounds for one). */
  speedup_low?: number | null;
  speedup_high?: number | null;
  /** Absent in reports from before paired rounds (then the speedup alone is read). */
  verdict?: SpeedupVerdict | null;
  rounds?: number | null;
  /** The budget ran out before the interval settled: the --budget that would tell. */
  budget_to_tell_s?: number | null;
  /** The most the fix's evidence lets it gain, where that cannot pass the band: not timed. */
  at_most?: number | null;
  error: string | null;
}

/** Other processes' CPU time on the kernel's CPUs while it measured. */
export interface ILoad {
  window_s: number;
  other_cpu_s: number;
  cpus: number;
}

export interface IRankTime {
  rank: number;
  host: string;
  baseline_s: number | null;
  collective_share?: number | null;
}

/** The torchrun job the cell was measured in (report.py's Distributed). */
export interface IDistributed {
  world_size: number;
  backend: string;
  nodes: number;
  ranks: IRankTime[];
}

/** A failure of perfcheck's own machinery, contained at its part (report.py's OwnFailure). */
export interface IOwnFailure {
  part: string;
  reason: string;
  traceback?: string;
}

/**
 * A check whose own trial settled it here without a finding: e.g. "slower here", the fix
 * measured slower by the check itself (channels-last's per-conv timing).
 */
export interface IChecked {
  id: string;
  title: string;
  outcome: string;
  evidence: string;
}

export interface INotApplicable {
  id: string;
  reason: string;
}

export interface ISampling {
  unit: string;
  steps_per_run: number | null;
  steps_detail: string;
  warmup_steps: number;
  steps_timed: number;
  probe_steps: number;
  probe_complete: boolean;
  epoch_end_step?: number | null;
  steps_per_epoch?: number | null;
}

export interface ICellRun {
  status: 'probe' | 'running' | 'complete' | 'interrupted' | 'failed' | 'skipped';
  seconds?: number | null;
  steps?: number | null;
  fixes?: string[];
  detail?: string | null;
}

export interface IOutOfMemory {
  error: string;
  line: number | null;
  requested_bytes: number | null;
  in_use_bytes: number | null;
  in_use_measure: string;
}

export interface IReport {
  schema: typeof SCHEMA_ID;
  run_id?: string;
  cell?: string;
  environment: IEnvironment;
  baseline: IBaseline;
  findings: IFinding[];
  variants: IVariant[];
  not_applicable?: INotApplicable[];
  checked?: IChecked[];
  applied?: string[];
  warnings?: string[];
  budget_s?: number | null;
  elapsed_s?: number | null;
  phase?: Phase;
  sampling?: ISampling | null;
  cell_run?: ICellRun | null;
  oom?: IOutOfMemory | null;
  notebook_edits?: INotebookEdits | null;
  /** Fixes measured clearly faster with results the same or within tolerance. */
  recommended?: string[] | null;
  load?: ILoad | null;
  distributed?: IDistributed | null;
  failures?: IOwnFailure[];
  /** Seconds by part of the baseline's first measuring run (measuring/time_split.py). */
  time_split?: Record<string, number> | null;
}

function isObject(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

/**
 * Check the shape the view relies on; the full schema is validated on the Python side.
 *
 * @throws Error naming the first missing or mistyped field.
 */
export function parseReport(data: unknown): IReport {
  if (!isObject(data)) {
    throw new Error('the report is not a JSON object');
  }
  if (data.schema !== SCHEMA_ID) {
    throw new Error(`unsupported report schema ${JSON.stringify(data.schema)}`);
  }
  for (const key of ['environment', 'baseline']) {
    if (!isObject(data[key])) {
      throw new Error(`"${key}" is missing or not an object`);
    }
  }
  for (const key of ['findings', 'variants']) {
    if (!Array.isArray(data[key]) || !(data[key] as unknown[]).every(isObject)) {
      throw new Error(`"${key}" is missing or not a list of objects`);
    }
  }
  for (const key of ['not_applicable', 'checked', 'warnings', 'applied', 'failures']) {
    if (data[key] !== undefined && !Array.isArray(data[key])) {
      throw new Error(`"${key}" is not a list`);
    }
  }
  return data as unknown as IReport;
}

function key(fixes: string[]): string {
  return [...fixes].sort().join('\u0000');
}

/** Numbers are still coming in: "measuring…" where one is missing. */
export function isMeasuring(report: IReport): boolean {
  return report.phase === 'measuring';
}

/** The newest measurement of exactly these fixes (`variants` keeps every measurement). */
export function variantFor(report: IReport, fixes: string[]): IVariant | undefined {
  const wanted = key(fixes);
  for (let i = report.variants.length - 1; i >= 0; i--) {
    if (key(report.variants[i].fixes) === wanted) {
      return report.variants[i];
    }
  }
  return undefined;
}

/** One variant per fix set, its newest measurement, in first-measured order. */
export function latestVariants(report: IReport): IVariant[] {
  const order: string[] = [];
  const latest = new Map<string, IVariant>();
  for (const variant of report.variants) {
    const k = key(variant.fixes);
    if (!latest.has(k)) {
      order.push(k);
    }
    latest.set(k, variant);
  }
  return order.map(k => latest.get(k) as IVariant);
}

/** Earlier measurements of the same fix set as `variant`, oldest first, `variant` excluded. */
export function earlierMeasurements(report: IReport, variant: IVariant): IVariant[] {
  const k = key(variant.fixes);
  return report.variants.filter(v => v !== variant && key(v.fixes) === k && v.speedup !== null);
}

/** The variant measuring this finding's fix alone, newest first. */
export function soloVariant(report: IReport, findingId: string): IVariant | undefined {
  return variantFor(report, [findingId]);
}

/** Whether these fixes are the report's recommended set (two or more of them). */
export function isRecommendedSet(report: IReport, fixes: string[]): boolean {
  const recommended = report.recommended ?? null;
  return recommended !== null && fixes.length > 1 && key(recommended) === key(fixes);
}

/** A short name for a variant: its fix ids, or "recommended fixes" for that set. */
export function variantLabel(report: IReport, variant: IVariant): string {
  return isRecommendedSet(report, variant.fixes) ? 'recommended fixes' : variant.fixes.join(' + ');
}

/**
 * A clear win: the speedup's interval above 1 and the speedup past the no-change band
 * (reports from before paired rounds: the speedup past the band), without error.
 */
export function isWin(variant: IVariant | undefined): boolean {
  if (variant === undefined || variant.error !== null || variant.speedup === null) {
    return false;
  }
  if (variant.verdict) {
    return variant.verdict === 'faster';
  }
  return variant.speedup >= 1 + NO_CHANGE_BAND;
}

/** Measured slower: the whole interval below 1 (older reports: a speedup below 1). */
export function isSlower(variant: IVariant | undefined): boolean {
  if (variant === undefined || variant.error !== null || variant.speedup === null) {
    return false;
  }
  if (variant.verdict) {
    return variant.verdict === 'slower';
  }
  return variant.speedup < 1;
}

/**
 * A check that fired and whose fix, measured alone, gained nothing clear — not a win,
 * with an interval that settled (more budget would not have told otherwise), no error,
 * not a memory fix judged by memory — once measuring is done. Shown apart ("checked: no
 * gain here"), never as a finding to act on; while numbers come in, nothing is concluded.
 */
export function isNoGain(report: IReport, finding: IFinding): boolean {
  if (!finding.fixable || isMeasuring(report)) {
    return false;
  }
  const variant = soloVariant(report, finding.id);
  if (variant !== undefined && variant.at_most != null && variant.speedup === null) {
    return true; // too small to matter: not timed
  }
  return (
    variant !== undefined &&
    variant.error === null &&
    variant.speedup !== null &&
    variant.judged_by !== 'memory' &&
    !isWin(variant) &&
    !variant.budget_to_tell_s
  );
}

/** Measured against the latest baseline (a Re-time since measured other fixes). */
export function isCurrent(report: IReport, variant: IVariant): boolean {
  const at = variant.measured_at;
  const base = report.baseline.measured_at;
  return !at || !base || at >= base;
}
