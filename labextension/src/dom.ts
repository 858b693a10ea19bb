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

type Child = Node | string | null | undefined | false;

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
