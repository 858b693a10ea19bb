/** Plain-text formatting of the report's numbers. */

const DASH = '—';

/** A duration in seconds, with a unit that keeps three significant digits. */
export function formatSeconds(seconds: number | null | undefined): string {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) {
    return DASH;
  }
  const abs = Math.abs(seconds);
  if (abs >= 1) {
    return `${seconds.toPrecision(3)} s`;
  }
  if (abs >= 1e-3) {
    return `${(seconds * 1e3).toPrecision(3)} ms`;
  }
  if (abs >= 1e-6) {
    return `${(seconds * 1e6).toPrecision(3)} µs`;
  }
  return seconds === 0 ? '0 s' : `${(seconds * 1e9).toPrecision(3)} ns`;
}

const BYTE_UNITS = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];

/** A byte count in binary units (MiB, GiB ...). */
export function formatBytes(bytes: number | null | undefined): string {
  if (bytes === null || bytes === undefined || !Number.isFinite(bytes)) {
    return DASH;
  }
  let value = Math.abs(bytes);
  let unit = 0;
  while (value >= 1024 && unit < BYTE_UNITS.length - 1) {
    value /= 1024;
    unit += 1;
  }
  const sign = bytes < 0 ? '−' : '';
  const digits = unit === 0 ? value.toFixed(0) : value.toFixed(1);
  return `${sign}${digits} ${BYTE_UNITS[unit]}`;
}

/** "median ± IQR" for a timing. */
export function formatTiming(median: number | null, iqr: number | null): string {
  if (median === null) {
    return DASH;
  }
  return iqr === null ? formatSeconds(median) : `${formatSeconds(median)} ± ${formatSeconds(iqr)}`;
}

/** A speedup factor such as "1.54×". */
export function formatFactor(factor: number): string {
  return `${factor.toFixed(2)}×`;
}

/** The change of peak memory from the baseline, e.g. "−4.0 MiB (−1.4%)". */
export function formatMemoryChange(baseline: number | null, variant: number | null): string {
  if (baseline === null || variant === null) {
    return DASH;
  }
  const delta = variant - baseline;
  if (delta === 0) {
    return 'no change';
  }
  const sign = delta > 0 ? '+' : '';
  const percent = baseline > 0 ? ` (${delta > 0 ? '+' : '−'}${Math.abs((100 * delta) / baseline).toFixed(1)}%)` : '';
  return `${sign}${formatBytes(delta)}${percent}`;
}
