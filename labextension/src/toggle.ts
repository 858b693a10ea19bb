/** Adding and removing the `%%perfcheck` line of a cell's source. */

const MAGIC = '%%perfcheck';
const MAGIC_LINE = /^%%perfcheck(?:\s.*)?$/;

/** Whether the source starts (after blank lines) with a `%%perfcheck` line. */
export function hasPerfcheck(source: string): boolean {
  const first = source.split('\n').find(line => line.trim() !== '');
  return first !== undefined && MAGIC_LINE.test(first);
}

/**
 * Remove the `%%perfcheck` line (with its options) when present, otherwise add a bare one
 * as the first line. Toggling twice gives the original source back.
 */
export function togglePerfcheck(source: string): string {
  const lines = source.split('\n');
  const index = lines.findIndex(line => line.trim() !== '');
  if (index !== -1 && MAGIC_LINE.test(lines[index])) {
    lines.splice(index, 1);
    return lines.join('\n');
  }
  return `${MAGIC}\n${source}`;
}
