/**
 * The sidebar's state: daemon status, entries, actions in flight and notices.
 *
 * It talks to the server only through an {@link IOvermindAPI}, so jest drives it with an
 * in-memory API and the widget with the REST one (`api.ts`).
 */

import { ISignal, Signal } from '@lumino/signaling';

import { sortEntries } from './format';
import { IEntry, IOvermindAPI, IStatus, SortKey } from './types';

/** What is being done to an entry right now, from the user's side. */
export type PendingAction = 'evict' | 'refresh';

/** A message shown above the list until dismissed or replaced. */
export interface INotice {
  kind: 'info' | 'error';
  text: string;
}

/** A refresh this sidebar started, followed until the daemon says how it ended. */
interface IWatchedRefresh {
  name: string;
  /** True once the entry was seen with `refresh.state === 'running'`. */
  seenRunning: boolean;
}

export class OvermindModel {
  constructor(api: IOvermindAPI) {
    this._api = api;
  }

  /** Emitted after every change of state. */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** Last daemon status, or null before the first poll answered. */
  get status(): IStatus | null {
    return this._status;
  }

  /** Entries in the current sort order. */
  get entries(): IEntry[] {
    return sortEntries(this._entries, this._sortBy);
  }

  /** Why the last poll failed (server unreachable, extension missing), or null. */
  get error(): string | null {
    return this._error;
  }

  get notice(): INotice | null {
    return this._notice;
  }

  get sortBy(): SortKey {
    return this._sortBy;
  }

  set sortBy(value: SortKey) {
    if (value !== this._sortBy) {
      this._sortBy = value;
      this._changed.emit();
    }
  }

  /** Whether the daemon is starting at the user's request. */
  get starting(): boolean {
    return this._starting;
  }

  /** Whether an evict-all request is in flight. */
  get evictingAll(): boolean {
    return this._evictingAll;
  }

  /** The user's action in flight on an entry, if any. */
  pending(key: string): PendingAction | null {
    return this._pending.get(key) ?? null;
  }

  /** Whether a row shows refresh progress: requested, or running in the daemon. */
  isRefreshing(entry: IEntry): boolean {
    return this._pending.get(entry.key) === 'refresh' || entry.refresh.state === 'running';
  }

  /** Whether some refresh is still running (the sidebar then polls faster). */
  get hasRunningRefresh(): boolean {
    return (
      this._watched.size > 0 ||
      this._entries.some(e => e.refresh.state === 'running') ||
      [...this._pending.values()].includes('refresh')
    );
  }

  dismissNotice(): void {
    if (this._notice) {
      this._notice = null;
      this._changed.emit();
    }
  }

  /** Fetch status and entries. Rejects when the server cannot be reached (Poll backs off). */
  async update(): Promise<void> {
    try {
      const [status, entries] = await Promise.all([this._api.status(), this._api.entries()]);
      this._status = status;
      this._entries = entries;
      this._error = null;
      this._followRefreshes();
    } catch (reason) {
      this._error = messageOf(reason);
      throw reason;
    } finally {
      this._changed.emit();
    }
  }

  async startDaemon(): Promise<void> {
    this._starting = true;
    this._changed.emit();
    try {
      this._status = await this._api.startDaemon();
      this._notice = null;
    } catch (reason) {
      this._notice = { kind: 'error', text: `Could not start the daemon: ${messageOf(reason)}` };
    } finally {
      this._starting = false;
    }
    await this._settle();
  }

  async evict(key: string): Promise<void> {
    const entry = this._entries.find(e => e.key === key);
    await this._act(key, 'evict', async () => {
      await this._api.evict(key);
      this._entries = this._entries.filter(e => e.key !== key);
      this._notice = { kind: 'info', text: `Evicted ${entry?.name ?? key}.` };
    });
  }

  async refresh(key: string): Promise<void> {
    const entry = this._entries.find(e => e.key === key);
    await this._act(key, 'refresh', async () => {
      // The daemon may answer with a partial entry (key, name, refresh): merge it.
      const updated: Partial<IEntry> & Pick<IEntry, 'refresh'> = await this._api.refresh(key);
      const name = updated.name || entry?.name || key;
      this._entries = this._entries.map(e => (e.key === key ? { ...e, ...updated } : e));
      if (updated.refresh.state === 'failed') {
        // e.g. a call that cannot be replayed: the daemon evicted it and says why.
        const why = updated.refresh.message || 'no reason given';
        this._notice = { kind: 'error', text: `Refresh of ${name} failed: ${why}` };
        return;
      }
      this._watched.set(key, { name, seenRunning: updated.refresh.state === 'running' });
      this._notice = null;
    });
  }

  async evictAll(): Promise<void> {
    this._evictingAll = true;
    this._changed.emit();
    try {
      const evicted = await this._api.evictAll();
      this._entries = [];
      const n = evicted.length;
      this._notice = { kind: 'info', text: `Evicted ${n} ${n === 1 ? 'entry' : 'entries'}.` };
    } catch (reason) {
      this._notice = { kind: 'error', text: `Evict all failed: ${messageOf(reason)}` };
    } finally {
      this._evictingAll = false;
    }
    await this._settle();
  }

  private async _act(key: string, action: PendingAction, run: () => Promise<void>): Promise<void> {
    if (this._pending.has(key)) {
      return; // one action per row at a time: a double click must not evict twice
    }
    this._pending.set(key, action);
    this._changed.emit();
    try {
      await run();
    } catch (reason) {
      this._notice = { kind: 'error', text: `${capitalize(action)} failed: ${messageOf(reason)}` };
    } finally {
      this._pending.delete(key);
    }
    await this._settle();
  }

  /** Re-read the server after an action; a failure here shows as the poll error. */
  private async _settle(): Promise<void> {
    try {
      await this.update();
    } catch {
      // update() recorded the error for display and emitted `changed`.
    }
  }

  /**
   * Turn the end of a refresh this sidebar started into a notice. When neither the old
   * entry nor its replacement is listed, the refresh is over too (e.g. evicted meanwhile).
   */
  private _followRefreshes(): void {
    for (const [key, watch] of [...this._watched]) {
      // A refresh whose source changed stores a new entry (its `refresh.previous` names
      // the old key) and drops the old one.
      const entry =
        this._entries.find(e => e.key === key) ??
        this._entries.find(e => e.refresh.previous === key);
      const state = entry?.refresh.state;
      if (state === 'running') {
        watch.seenRunning = true;
        continue;
      }
      if (state === 'idle' && !watch.seenRunning) {
        continue; // the daemon has not picked it up yet
      }
      this._watched.delete(key);
      if (state === 'failed') {
        const why = entry?.refresh.message || 'no reason given';
        this._notice = { kind: 'error', text: `Refresh of ${watch.name} failed: ${why}` };
      } else {
        const detail = entry?.refresh.message ? `: ${entry.refresh.message}` : '.';
        this._notice = { kind: 'info', text: `Refreshed ${watch.name}${detail}` };
      }
    }
  }

  private _api: IOvermindAPI;
  private _changed = new Signal<this, void>(this);
  private _status: IStatus | null = null;
  private _entries: IEntry[] = [];
  private _error: string | null = null;
  private _notice: INotice | null = null;
  private _sortBy: SortKey = 'last_used';
  private _pending = new Map<string, PendingAction>();
  private _watched = new Map<string, IWatchedRefresh>();
  private _starting = false;
  private _evictingAll = false;
}

/** The message of an error from the API (ServerConnection errors carry the server's). */
export function messageOf(reason: unknown): string {
  if (reason instanceof Error) {
    return reason.message;
  }
  return String(reason);
}

function capitalize(s: string): string {
  return s.charAt(0).toUpperCase() + s.slice(1);
}
