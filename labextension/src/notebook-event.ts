/**
 * How the view asks for "Apply to notebook": a bubbling DOM event, answered by the
 * labextension plugin (`notebook-edits.ts`), which alone can reach the notebook model.
 *
 * The live panel is an anywidget ES module: it cannot import JupyterLab, and in VS Code or
 * Colab there is no JupyterLab at all. So the view dispatches `ttm-apply-to-notebook` from
 * its own node; the plugin, when loaded, marks `<body>` with `data-ttm-notebook-edits`
 * and handles the event for the notebook that holds the node. Where the mark is missing
 * the view explains instead of offering a button that could do nothing.
 */

import { ICellChange } from './report';

export const APPLY_EVENT = 'ttm-apply-to-notebook';
export const AVAILABLE_ATTR = 'data-ttm-notebook-edits';

export interface IApplyOutcome {
  ok: boolean;
  message: string;
}

export interface IApplyRequest {
  /** The fix ids the edits are for (shown in the confirmation). */
  fixes: string[];
  cells: ICellChange[];
  /** Called once with what happened (applied, cancelled or refused). */
  respond: (outcome: IApplyOutcome) => void;
}

/** Whether a front end here can edit notebook cells (the labextension is loaded). */
export function canApplyToNotebook(): boolean {
  return typeof document !== 'undefined' && document.body !== null && document.body.hasAttribute(AVAILABLE_ATTR);
}

/** Ask the labextension to apply these cell edits to the notebook holding `from`. */
export function requestApply(from: Element, request: IApplyRequest): void {
  from.dispatchEvent(new CustomEvent<IApplyRequest>(APPLY_EVENT, { bubbles: true, composed: true, detail: request }));
}
