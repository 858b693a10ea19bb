/**
 * The report produced by `%%perfcheck` (schema `torchtune-magic/report/v1`,
 * see `torchtune_magic/report.schema.json`) and the lookups the views need.
 */

export const MIME_TYPE = 'application/vnd.torchtune-magic.report.v1+json';
export const SCHEMA_ID = 'torchtune-magic/report/v1';

export type Verdict = 'identical' | 'close' | 'changed' | 'not-compared';

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
  /** Model FLOPs of one run. */
  flops?: number | null;
  /** FLOPs of one run / median_s, in TFLOP/s. */
  achieved_tflops?: number | null;
  /** Share of the device's peak; null where no peak is known. */
  utilisation?: number | null;
  /** The effective peak the share is of (this configuration's precision mix). */
  peak_tflops?: number | null;
}

export interface IStats extends IThroughput {
  median_s: number | null;
  iqr_s: number | null;
  runs: number;
  peak_memory_bytes: number | null;
  noisy?: boolean;
}

export interface IBaseline extends IStats {
  /** FLOPs by "dtype kind", e.g. "float32 conv". */
  flops_breakdown?: Record<string, number> | null;
  /** Why FLOPs were not counted, when they were not. */
  flops_detail?: string | null;
}

export interface ICodeChange {
  diff: string;
  elsewhere: string[];
}

export interface IFinding {
  id: string;
  title: string;
  evidence: string;
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
}

export interface IVariant extends IStats {
  fixes: string[];
  speedup: number | null;
  numerics: INumerics;
  one_time_s: number | null;
  break_even_runs?: number | null;
  error: string | null;
}

export interface INotApplicable {
  id: string;
  reason: string;
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
  applied?: string[];
  warnings?: string[];
  budget_s?: number | null;
  elapsed_s?: number | null;
}

function isObject(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

/**
 * Check the shape the views rely on; the full schema is validated on the Python side.
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
  for (const key of ['not_applicable', 'warnings', 'applied']) {
    if (data[key] !== undefined && !Array.isArray(data[key])) {
      throw new Error(`"${key}" is not a list`);
    }
  }
  return data as unknown as IReport;
}

/** The variant measuring this finding's fix alone (`fixes == [id]`), if any. */
export function soloVariant(report: IReport, findingId: string): IVariant | undefined {
  return report.variants.find(v => v.fixes.length === 1 && v.fixes[0] === findingId);
}

/** A short name for a variant: its fix ids, or "all fixes" for the combined one. */
export function variantLabel(report: IReport, variant: IVariant): string {
  const fixable = report.findings.filter(f => f.fixable).length;
  if (variant.fixes.length > 1 && variant.fixes.length === fixable) {
    return 'all fixes';
  }
  return variant.fixes.join(' + ');
}
