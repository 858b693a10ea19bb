/**
 * The `torchtune-magic:toggle-perfcheck` command (its toolbar button, context-menu item
 * and keyboard shortcut are declared in `schema/plugin.json` so users can change them)
 * and "Apply to notebook" (notebook-edits.ts).
 */

import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { INotebookTracker } from '@jupyterlab/notebook';
import { perfcheckIcon } from './icon';
import { APPLY_COMMAND, activateNotebookEdits } from './notebook-edits';
import { hasPerfcheck, togglePerfcheck } from './toggle';

export const TOGGLE_COMMAND = 'torchtune-magic:toggle-perfcheck';

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'torchtune-magic:plugin',
  description: 'Adds the "Toggle %%perfcheck" and "Apply %%perfcheck changes to notebook" commands.',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [ICommandPalette],
  activate: (app: JupyterFrontEnd, tracker: INotebookTracker, palette: ICommandPalette | null) => {
    const activeCodeCell = () => {
      const cell = tracker.activeCell;
      return cell !== null && cell.model.type === 'code' ? cell : null;
    };

    app.commands.addCommand(TOGGLE_COMMAND, {
      label: 'Toggle %%perfcheck',
      caption: 'Add or remove the %%perfcheck line on the active code cell',
      icon: perfcheckIcon,
      isEnabled: () => activeCodeCell() !== null,
      isToggled: () => {
        const cell = activeCodeCell();
        return cell !== null && hasPerfcheck(cell.model.sharedModel.getSource());
      },
      execute: () => {
        const cell = activeCodeCell();
        if (cell !== null) {
          const shared = cell.model.sharedModel;
          shared.setSource(togglePerfcheck(shared.getSource()));
        }
      }
    });

    const refresh = () => app.commands.notifyCommandChanged(TOGGLE_COMMAND);
    tracker.activeCellChanged.connect(refresh);
    tracker.currentChanged.connect(refresh);

    activateNotebookEdits(app, tracker);

    palette?.addItem({ command: TOGGLE_COMMAND, category: 'Notebook Cell Operations' });
    palette?.addItem({ command: APPLY_COMMAND, category: 'Notebook Cell Operations' });
  }
};

export default plugin;
