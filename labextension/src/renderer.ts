/** The MIME renderer widget for the %%perfcheck report. */

import { IRenderMime } from '@jupyterlab/rendermime-interfaces';
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';
import { LivePanelWatcher } from './coexist';
import { h } from './dom';
import { parseReport } from './report';
import { renderReport } from './view';

export class ReportRenderer extends Widget implements IRenderMime.IRenderer {
  constructor(options: IRenderMime.IRendererOptions) {
    super();
    this.mimeType = options.mimeType;
    this.addClass('ttm-ReportRenderer');
    this.watcher = new LivePanelWatcher(this.node);
  }

  renderModel(model: IRenderMime.IMimeModel): Promise<void> {
    this.node.replaceChildren();
    try {
      const report = parseReport(model.data[this.mimeType]);
      this.node.appendChild(renderReport(report));
      this.watcher.runId = report.run_id ?? null;
    } catch (error) {
      this.node.appendChild(
        h('div', { className: 'ttm-invalid', text: `Cannot show the %%perfcheck report: ${(error as Error).message}` })
      );
      this.watcher.runId = null;
    }
    return Promise.resolve();
  }

  dispose(): void {
    this.watcher.detach();
    super.dispose();
  }

  protected onAfterAttach(msg: Message): void {
    super.onAfterAttach(msg);
    this.watcher.attach();
  }

  protected onBeforeDetach(msg: Message): void {
    this.watcher.detach();
    super.onBeforeDetach(msg);
  }

  readonly mimeType: string;
  private readonly watcher: LivePanelWatcher;
}
