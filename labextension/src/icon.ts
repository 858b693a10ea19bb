/** The toolbar / menu icon: a gauge. */

import { LabIcon } from '@jupyterlab/ui-components';

const svgstr = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
  <path class="jp-icon3" fill="#616161" d="M12 4a10 10 0 0 0-8.66 15h17.32A10 10 0 0 0 12 4zm0 2a8 8 0 0 1 7.41 11H4.59A8 8 0 0 1 12 6zm4.24 2.35-5.3 5.3a1.5 1.5 0 1 0 2.12 2.12l3.18-7.42z"/>
</svg>`;

export const perfcheckIcon = new LabIcon({ name: 'torchtune-magic:perfcheck', svgstr });
