/** The MIME extension: renders `application/vnd.torchtune-magic.report.v1+json`. */

import { IRenderMime } from '@jupyterlab/rendermime-interfaces';
import { MIME_TYPE } from './report';
import { ReportRenderer } from './renderer';

const extension: IRenderMime.IExtension = {
  id: 'torchtune-magic:report-renderer',
  description: 'Renders the %%perfcheck report saved in notebook outputs.',
  rendererFactory: {
    // No HTML or script ever comes from the report: every string is rendered as text.
    safe: true,
    mimeTypes: [MIME_TYPE],
    defaultRank: 0,
    createRenderer: options => new ReportRenderer(options)
  },
  rank: 0
};

export default extension;
