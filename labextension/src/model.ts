/**
 * The sidebar's state: daemon status, entries, actions in flight and notices.
 *
 * It talks to the server only through an {@link IOvermindAPI}, so jest drives it with an
 * in-memory API and the widget with the REST one (`api.ts`).
 */

import { ISignal, Signal } from '@lumino/signaling';

import { sortEntries } from './format';
import { IEntry, IOvermindAPI, IStatus, IZygote, SortKey } from './types';

/** What is being done to an entry right now, from the user's side. */
export type PendingAction = 'evict' | 'refresh';

/** An action on the whole panel, one at a time each. */
type PanelAction = 'start' | 'evict-all' | 'restart-zygotes';

/** A message shown above the list until dismissed or replaced. */
export interface INotice {
  kind: 'info' | 'error';
  text: string;
}

/**
 * How long the sidebar waits for a restarted zygote's replacement (it imports torch,
 * diffusers, transformers...) before it says the restart did not finish.
 */
export const ZYGOTE_RESTART_TIMEOUT_MS = 5 * 60 * 1000;

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

  /** The warm-kernel zygotes (empty when none runs). */
  get zygotes(): IZygote[] {
    return this._zygotes;
  }

  /** Whether a restart request for the zygotes is in flight. */
  get restartingZygotes(): boolean {
    return this._busy.has('restart-zygotes');
  }

  /**
   * Whether a restart this sidebar asked for still waits for its replacement: the old
   * zygote stops forking (and leaves the list) at once, the new one is listed when its
   * imports are done.
   */
  get awaitingZygote(): boolean {
    return this._replacing !== null;
  }

  /** Whether `pid` is a zygote this sidebar asked to restart (it is being replaced). */
  isReplaced(pid: number): boolean {
    return this._replacing?.pids.includes(pid) ?? false;
  }

  /** Whether the daemon is starting at the user's request. */
  get starting(): boolean {
    return this._busy.has('start');
  }

  /** Whether an evict-all request is in flight. */
  get evictingAll(): boolean {
    return this._busy.has('evict-all');
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

  /**
   * Fetch status, entries and zygotes. Rejects when the server cannot be reached (Poll
   * backs off).
   */
  async update(): Promise<void> {
    try {
      const [status, entries, zygotes] = await Promise.all([
        this._api.status(),
        this._api.entries(),
        this._api.zygotes()
      ]);
      this._status = status;
      this._entries = entries;
      this._zygotes = zygotes;
      this._error = null;
      this._followRefreshes();
      this._followZygoteRestart();
    } catch (reason) {
      this._error = messageOf(reason);
      throw reason;
    } finally {
      this._changed.emit();
    }
  }

  async startDaemon(): Promise<void> {
    await this._panelAct('start', 'Could not start the daemon', async () => {
      this._status = await this._api.startDaemon();
      this._notice = null;
    });
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
    await this._panelAct('evict-all', 'Evict all failed', async () => {
      const evicted = await this._api.evictAll();
      this._entries = [];
      const n = evicted.length;
      this._notice = { kind: 'info', text: `Evicted ${n} ${n === 1 ? 'entry' : 'entries'}.` };
    });
  }

  /** Ask every zygote to restart (fresh imports); followed until the replacement is up. */
  async restartZygotes(): Promise<void> {
    await this._panelAct('restart-zygotes', 'Restart of the zygote failed', async () => {
      const pids = await this._api.restartZygotes();
      if (pids.length === 0) {
        this._notice = { kind: 'info', text: 'No zygote was running: nothing to restart.' };
      } else {
        this._replacing = { pids, since: Date.now() };
        this._notice = null;
      }
    });
  }

  /** Run an action on the whole panel; a failure becomes an error notice `failed: why`. */
  private async _panelAct(
    action: PanelAction,
    failed: string,
    run: () => Promise<void>
  ): Promise<void> {
    if (this._busy.has(action)) {
      return; // a double click must not start it twice
    }
    this._busy.add(action);
    this._changed.emit();
    try {
      await run();
    } catch (reason) {
      this._notice = { kind: 'error', text: `${failed}: ${messageOf(reason)}` };
    } finally {
      this._busy.delete(action);
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

  /** End a zygote restart once a zygote other than the restarted ones serves. */
  private _followZygoteRestart(): void {
    const replacing = this._replacing;
    if (replacing === null) {
      return;
    }
    const fresh = this._zygotes.filter(z => !replacing.pids.includes(z.pid) && !z.retiring);
    if (fresh.length > 0) {
      this._replacing = null;
      const pids = fresh.map(z => z.pid).join(', ');
      this._notice = { kind: 'info', text: `Zygote restarted: now pid ${pids}.` };
    } else if (Date.now() - replacing.since > ZYGOTE_RESTART_TIMEOUT_MS) {
      this._replacing = null;
      const minutes = Math.round(ZYGOTE_RESTART_TIMEOUT_MS / 60_000);
      this._notice = {
        kind: 'error',
        text:
          `No new zygote after ${minutes} min: its imports may have failed (see ` +
          'zygote-*.log beside the daemon socket). The next warm-kernel launch starts one.'
      };
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
  private _zygotes: IZygote[] = [];
  private _replacing: { pids: number[]; since: number } | null = null;
  private _busy = new Set<PanelAction>();
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
