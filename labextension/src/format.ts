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

/** A speedup factor such as "1.54×"; "0.997×" where two decimals would read 1.00×. */
export function formatFactor(factor: number): string {
  const two = factor.toFixed(2);
  return two === '1.00' && factor !== 1 ? `${factor.toFixed(3)}×` : `${two}×`;
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

function finite(value: number | null | undefined): value is number {
  return typeof value === 'number' && Number.isFinite(value);
}

/** Three significant digits without trailing zeros (Python's `:.3g`). */
function significant(value: number): string {
  return String(Number(value.toPrecision(3)));
}

/** A FLOP count such as "2.9 TFLOP" (the wording of `render/summary.py`). */
export function formatFlops(flops: number | null | undefined): string {
  if (!finite(flops)) {
    return DASH;
  }
  for (const [unit, scale] of [
    ['TFLOP', 1e12],
    ['GFLOP', 1e9],
    ['MFLOP', 1e6]
  ] as const) {
    if (flops >= scale) {
      return `${(flops / scale).toFixed(1)} ${unit}`;
    }
  }
  return `${flops} FLOP`;
}

/** An achieved rate given in TFLOP/s: "24.6 TFLOP/s", or "562 GFLOP/s" below 1 TFLOP/s. */
export function formatRate(tflops: number | null | undefined): string {
  if (!finite(tflops)) {
    return DASH;
  }
  return tflops >= 1 ? `${significant(tflops)} TFLOP/s` : `${significant(tflops * 1e3)} GFLOP/s`;
}

/** "36.1% of peak", or "no peak known" when there is no peak to compare with (never 0%). */
export function formatShareOfPeak(utilisation: number | null | undefined): string {
  if (!finite(utilisation)) {
    return 'no peak known';
  }
  return `${(utilisation * 100).toFixed(1)}% of peak`;
}

/** A peak rate, "989.4 TFLOP/s". */
export function formatPeak(tflops: number): string {
  return `${tflops.toFixed(1)} TFLOP/s`;
}

/** An exponent as Python writes it: at least two digits (`e-07`, `e+03`). */
function pythonExponent(text: string): string {
  return text.replace(/e([+-])(\d)$/, 'e$10$2');
}

/** Python's `:.{digits}e`, e.g. 8.87e-08. */
export function formatExponent(value: number, digits: number): string {
  return pythonExponent(value.toExponential(digits));
}

/** Python's `:.{digits}g`: fixed or exponent notation, trailing zeros dropped. */
export function formatGeneral(value: number, digits: number): string {
  if (value === 0 || !Number.isFinite(value)) {
    return String(value);
  }
  const exponent = Number(value.toExponential(digits - 1).split('e')[1]);
  if (exponent < -4 || exponent >= digits) {
    const [mantissa, power] = value.toExponential(digits - 1).split('e');
    const trimmed = mantissa.includes('.') ? mantissa.replace(/\.?0+$/, '') : mantissa;
    return pythonExponent(`${trimmed}e${power}`);
  }
  return String(Number(value.toPrecision(digits)));
}
