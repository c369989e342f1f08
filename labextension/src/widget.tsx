/**
 * The sidebar widget: a ReactWidget around {@link OvermindPanel}, plus the poll that keeps
 * the model fresh while (and only while) the sidebar is visible.
 */

import { Dialog, showDialog } from '@jupyterlab/apputils';
import { ReactWidget } from '@jupyterlab/ui-components';
import { IPoll, Poll } from '@lumino/polling';
import { Message } from '@lumino/messaging';
import * as React from 'react';

import { OvermindPanel } from './components';
import { formatBytes, heldBytes } from './format';
import { OvermindModel } from './model';

/**
 * Seconds between polls while a refresh runs or a restarted zygote's replacement boots,
 * so their end is seen.
 */
const REFRESH_POLL_SECONDS = 1;
/** Longest back-off when the server does not answer. */
const MAX_BACKOFF_SECONDS = 300;

export class OvermindSidebar extends ReactWidget {
  constructor(model: OvermindModel, intervalSeconds = 5) {
    super();
    this.model = model;
    this.addClass('jp-OvermindLab-sidebar');
    this._interval = intervalSeconds;
    this._poll = new Poll({
      auto: true,
      factory: () => this.model.update(),
      frequency: this._frequency(),
      name: 'overmind-lab:status',
      // A hidden sidebar (another tab of the left area, collapsed area, hidden browser tab)
      // makes no requests at all.
      standby: () => !this.isVisible || 'when-hidden'
    });
    this.model.changed.connect(this._adjustFrequency, this);
  }

  readonly model: OvermindModel;

  /** Seconds between polls (from the extension's settings). */
  get interval(): number {
    return this._interval;
  }

  set interval(seconds: number) {
    this._interval = Math.max(1, seconds);
    this._adjustFrequency();
  }

  /** Fetch now (if visible), without waiting for the next tick. */
  refreshNow(): Promise<void> {
    return this._poll.refresh();
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this.model.changed.disconnect(this._adjustFrequency, this);
    this._poll.dispose();
    super.dispose();
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    void this._poll.refresh(); // show fresh numbers as soon as the panel opens
  }

  render(): JSX.Element {
    return (
      <OvermindPanel model={this.model} confirmEvictAll={() => this._confirmEvictAll()} />
    );
  }

  private async _confirmEvictAll(): Promise<boolean> {
    const count = this.model.entries.length;
    const bytes = this.model.status?.cached_bytes;
    const held = this.model.status ? heldBytes(this.model.status) : 0;
    const result = await showDialog({
      title: 'Evict all cached models?',
      body:
        `This drops ${count} ${count === 1 ? 'entry' : 'entries'}` +
        (bytes !== undefined ? ` (${formatBytes(bytes)})` : '') +
        ' from the cache' +
        (held > 0
          ? ` and lets go of ${formatBytes(held)} of your own files it holds open (they ` +
            'stay on disk)'
          : '') +
        '. Kernels that hold a model keep their copy; the next load of each model is cold ' +
        'again.',
      buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Evict all' })]
    });
    return result.button.accept;
  }

  private _frequency(): IPoll.Frequency {
    const fast = this.model.hasRunningRefresh || this.model.awaitingZygote;
    const seconds = fast ? Math.min(REFRESH_POLL_SECONDS, this._interval) : this._interval;
    return {
      interval: seconds * 1000,
      backoff: true,
      max: Math.max(seconds, MAX_BACKOFF_SECONDS) * 1000
    };
  }

  private _adjustFrequency(): void {
    const next = this._frequency();
    if (next.interval !== this._poll.frequency.interval) {
      this._poll.frequency = next;
      // The tick already scheduled used the old interval; start the new rhythm now.
      void this._poll.refresh();
    }
  }

  private _interval: number;
  private _poll: Poll;
}
