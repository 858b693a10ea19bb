/**
 * DOM construction helpers. Report strings only ever become text nodes:
 * nothing here parses HTML.
 */

export interface IElementOptions {
  className?: string;
  text?: string;
  title?: string;
  attrs?: Record<string, string>;
}

export type Child = Node | string | null | undefined | false;

function apply(node: Element, options: IElementOptions, children: Child[]): void {
  if (options.className) {
    node.setAttribute('class', options.className);
  }
  for (const [name, value] of Object.entries(options.attrs ?? {})) {
    node.setAttribute(name, value);
  }
  if (options.text !== undefined) {
    node.textContent = options.text;
  }
  for (const child of children) {
    if (typeof child === 'string') {
      node.appendChild(document.createTextNode(child));
    } else if (child) {
      node.appendChild(child);
    }
  }
}

/** Create an HTML element with text content, attributes and children. */
export function h<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  options: IElementOptions = {},
  ...children: Child[]
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  apply(node, options, children);
  if (options.title !== undefined) {
    node.title = options.title;
  }
  return node;
}

/** A `code` span in report prose (the text view shows the backticks, this view does not). */
const CODE_SPAN = /`([^`]+)`/g;
/** An option as the user types it (`--budget 90`, `--no-finish`): never broken inside. */
const OPTION = /--[a-z][a-z-]*(?: \d+(?:\.\d+)?)?/g;

/** Plain text with each option kept on one line; a stray backtick is dropped. */
function unbroken(text: string): Child[] {
  const plain = text.replace(/`/g, '');
  const children: Child[] = [];
  let last = 0;
  for (const match of plain.matchAll(OPTION)) {
    children.push(plain.slice(last, match.index), h('span', { className: 'ttm-nowrap', text: match[0] }));
    last = (match.index ?? 0) + match[0].length;
  }
  children.push(plain.slice(last));
  return children.filter(child => child !== '');
}

/**
 * Report prose as children for `h`: each `code` span becomes a <code> element (never a
 * literal backtick on screen), and an option such as --budget 90 never breaks inside.
 * Text nodes only: nothing is parsed as HTML.
 */
export function prose(text: string): Child[] {
  const children: Child[] = [];
  let last = 0;
  for (const match of text.matchAll(CODE_SPAN)) {
    children.push(...unbroken(text.slice(last, match.index)), h('code', { className: 'ttm-code', text: match[1] }));
    last = (match.index ?? 0) + match[0].length;
  }
  children.push(...unbroken(text.slice(last)));
  return children;
}

const SVG_NS = 'http://www.w3.org/2000/svg';

/** Create an SVG element; a `title` option becomes a `<title>` child (an SVG tooltip). */
export function s<K extends keyof SVGElementTagNameMap>(
  tag: K,
  options: IElementOptions = {},
  ...children: Child[]
): SVGElementTagNameMap[K] {
  const node = document.createElementNS(SVG_NS, tag);
  apply(node, options, children);
  if (options.title !== undefined) {
    const title = document.createElementNS(SVG_NS, 'title');
    title.textContent = options.title;
    node.insertBefore(title, node.firstChild);
  }
  return node;
}

/**
 * Copy text to the clipboard the way JupyterLab's `Clipboard.copyToSystem` does (a `copy`
 * event during `execCommand('copy')`), so it works without clipboard permissions and
 * outside JupyterLab (the live panel in VS Code or Colab) alike.
 */
export function copyText(text: string): void {
  const onCopy = (event: ClipboardEvent) => {
    event.clipboardData?.setData('text/plain', text);
    event.preventDefault();
  };
  document.addEventListener('copy', onCopy);
  try {
    document.execCommand('copy');
  } finally {
    document.removeEventListener('copy', onCopy);
  }
}
