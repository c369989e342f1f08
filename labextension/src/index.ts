/**
 * overmind-lab: a left sidebar that shows the warm-model cache (what is cached, what it
 * costs in memory, how much faster reloads are) with evict and refresh buttons.
 */

import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { ISettingRegistry } from '@jupyterlab/settingregistry';

import { RestAPI } from './api';
import { overmindIcon } from './icons';
import { OvermindModel } from './model';
import { SortKey } from './types';
import { OvermindSidebar } from './widget';

const PLUGIN_ID = 'overmind-lab:plugin';

namespace CommandIDs {
  export const open = 'overmind-lab:open';
  export const refresh = 'overmind-lab:refresh';
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description: 'A sidebar for the overmind-lab model cache: memory, timings, evict, refresh.',
  autoStart: true,
  optional: [ISettingRegistry, ILayoutRestorer, ICommandPalette],
  activate: (
    app: JupyterFrontEnd,
    settingRegistry: ISettingRegistry | null,
    restorer: ILayoutRestorer | null,
    palette: ICommandPalette | null
  ): void => {
    const model = new OvermindModel(new RestAPI(app.serviceManager.serverSettings));
    const sidebar = new OvermindSidebar(model);
    sidebar.id = 'jp-OvermindLab-sidebar';
    sidebar.title.icon = overmindIcon;
    sidebar.title.caption = 'Model cache (overmind-lab)';
    app.shell.add(sidebar, 'left', { rank: 650 });
    if (restorer) {
      restorer.add(sidebar, 'overmind-lab');
    }

    app.commands.addCommand(CommandIDs.open, {
      label: 'Show Model Cache',
      caption: 'Open the overmind-lab sidebar',
      execute: () => app.shell.activateById(sidebar.id)
    });
    app.commands.addCommand(CommandIDs.refresh, {
      label: 'Refresh Model Cache View',
      execute: () => sidebar.refreshNow()
    });
    if (palette) {
      palette.addItem({ command: CommandIDs.open, category: 'Model Cache' });
      palette.addItem({ command: CommandIDs.refresh, category: 'Model Cache' });
    }

    if (settingRegistry) {
      const apply = (settings: ISettingRegistry.ISettings): void => {
        sidebar.interval = settings.get('refreshInterval').composite as number;
        model.sortBy = settings.get('sortBy').composite as SortKey;
      };
      settingRegistry
        .load(PLUGIN_ID)
        .then(settings => {
          apply(settings);
          settings.changed.connect(apply);
        })
        .catch(reason => {
          console.error('overmind-lab: could not load settings', reason);
        });
    }
  }
};

export default plugin;
