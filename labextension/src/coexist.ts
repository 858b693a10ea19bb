/**
 * Coexistence of the saved report with the live panel (anywidget) of the same run.
 *
 * While the kernel is alive the cell shows the live panel (a widget whose root has the
 * classes `ttm-live-panel ttm-run-<run_id>` from its `_dom_classes`), so the report
 * hides itself. When the panel is not mounted (reopened notebook, kernel gone) the report
 * shows and the widget-view outputs of the cell that failed to render are hidden instead.
 *
 * How an unrendered widget-view output looks in the DOM (from @jupyter-widgets/jupyterlab-manager
 * `WidgetRenderer.renderModel` and @jupyterlab/outputarea): the output area wraps each output
 * in a `.jp-OutputArea-child` panel holding the renderer's node as `.jp-OutputArea-output`.
 * Renderers built on `RenderedCommon` (text, HTML, images ...) carry a `data-mime-type`
 * attribute; the widget renderer is a Lumino `Panel` (class `lm-Panel`) that does not. Until
 * the widget manager is restored it holds the bare text "Loading widget..." (for good when
 * there is no kernel); when the model cannot be found it reads
 * "Error displaying widget: model not found" (or "Error displaying widget" when the view
 * fails) and gets the class `jupyter-widgets`. A rendered widget has the view's element as a
 * child instead, so it never matches; a hidden output comes back as soon as that happens.
 *
 * In an untrusted notebook (not signed here) JupyterLab shows the widget output's text/plain
 * fallback instead. The live panel's repr is `torchtune-magic live panel (run <run_id>)`, so
 * a text/plain output reading exactly that is hidden as well.
 */

const HIDDEN_ATTR = 'data-ttm-hidden';
const OUTPUT_AREA = '.jp-OutputArea';
const OUTPUT_ITEM = 'jp-OutputArea-child';
const OUTPUT_NODE = 'jp-OutputArea-output';
const WIDGET_PLACEHOLDERS = ['Error displaying widget', 'Loading widget...'];

/** Whether a `.jp-OutputArea-output` node is a widget view that is not (or cannot be) shown. */
function isUnrenderedWidgetView(output: Element): boolean {
  const text = (output.textContent ?? '').trim();
  return (
    output.classList.contains(OUTPUT_NODE) &&
    output.classList.contains('lm-Panel') &&
    !output.hasAttribute('data-mime-type') &&
    output.childElementCount === 0 &&
    WIDGET_PLACEHOLDERS.some(placeholder => text.startsWith(placeholder))
  );
}

/** The text/plain fallback of the live panel of this run (its Python `repr`). */
function livePanelRepr(runId: string): string {
  return `torchtune-magic live panel (run ${runId})`;
}

function setHidden(node: HTMLElement, hidden: boolean): void {
  if (hidden && !node.hasAttribute(HIDDEN_ATTR)) {
    node.setAttribute(HIDDEN_ATTR, '');
    node.style.display = 'none';
  } else if (!hidden && node.hasAttribute(HIDDEN_ATTR)) {
    node.removeAttribute(HIDDEN_ATTR);
    node.style.display = '';
  }
}

/** Watches the cell's output area and shows either the live panel or the report. */
export class LivePanelWatcher {
  /**
   * @param host the report renderer's node (inside a cell's output area once attached)
   */
  constructor(private readonly host: HTMLElement) {
    this.observer = new MutationObserver(() => this.update());
  }

  /** The run whose live panel replaces the report; null matches no panel. */
  set runId(value: string | null) {
    this._runId = value;
    this.update();
  }

  /** Start watching the output area the host is now attached to. */
  attach(): void {
    this.detach();
    // The cell's own output area; nested areas (e.g. an Output widget) are not the cell's.
    this.area = (this.host.closest('.jp-Cell-outputArea') ?? this.host.closest(OUTPUT_AREA)) as HTMLElement | null;
    if (this.area === null) {
      return;
    }
    this.observer.observe(this.area, {
      childList: true,
      subtree: true,
      characterData: true,
      attributes: true,
      attributeFilter: ['class']
    });
    this.update();
  }

  /** Stop watching and undo every change made to the output area. */
  detach(): void {
    this.observer.disconnect();
    if (this.area !== null) {
      this.area.querySelectorAll<HTMLElement>(`[${HIDDEN_ATTR}]`).forEach(node => setHidden(node, false));
    }
    setHidden(this.ownItem(), false);
    this.area = null;
  }

  /** The output-area item holding the host (hiding it also hides its prompt). */
  private ownItem(): HTMLElement {
    const item = this.host.closest<HTMLElement>(`.${OUTPUT_ITEM}`);
    return item !== null && this.area !== null && item.parentElement === this.area ? item : this.host;
  }

  private livePanelMounted(): boolean {
    if (this.area === null || this._runId === null) {
      return false;
    }
    const selector = `.ttm-live-panel.ttm-run-${CSS.escape(this._runId)}`;
    return this.area.querySelector(selector) !== null;
  }

  /** Whether an output is what the live panel left behind: a placeholder or its repr. */
  private isLivePanelStandIn(output: Element): boolean {
    if (isUnrenderedWidgetView(output)) {
      return true;
    }
    return (
      this._runId !== null &&
      output.getAttribute('data-mime-type') === 'text/plain' &&
      (output.textContent ?? '').trim() === livePanelRepr(this._runId)
    );
  }

  private update(): void {
    if (this.area === null) {
      return;
    }
    const live = this.livePanelMounted();
    setHidden(this.ownItem(), live);
    for (const item of Array.from(this.area.children)) {
      if (!(item instanceof HTMLElement) || !item.classList.contains(OUTPUT_ITEM) || item.contains(this.host)) {
        continue;
      }
      const output = Array.from(item.children).find(child => child.classList.contains(OUTPUT_NODE));
      setHidden(item, !live && output !== undefined && this.isLivePanelStandIn(output));
    }
  }

  private readonly observer: MutationObserver;
  private area: HTMLElement | null = null;
  private _runId: string | null = null;
}
