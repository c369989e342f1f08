import { OvermindModel, ZYGOTE_RESTART_TIMEOUT_MS } from '../model';
import { makeEntry, makeZygote, MemoryAPI } from './fixtures';

function setup(): { api: MemoryAPI; model: OvermindModel; changes: () => number } {
  const api = new MemoryAPI();
  const model = new OvermindModel(api);
  let n = 0;
  model.changed.connect(() => {
    n += 1;
  });
  return { api, model, changes: () => n };
}

describe('OvermindModel.update', () => {
  it('reads status and entries, in the chosen order', async () => {
    const { api, model, changes } = setup();
    api.entryList = [
      makeEntry({ key: 'aa', bytes: 1, last_used: 2 }),
      makeEntry({ key: 'bb', bytes: 9, last_used: 1 })
    ];
    expect(model.status).toBeNull();
    await model.update();
    expect(model.status?.running).toBe(true);
    expect(model.status?.entries).toBe(2);
    expect(model.entries.map(e => e.key)).toEqual(['aa', 'bb']);
    model.sortBy = 'bytes';
    expect(model.entries.map(e => e.key)).toEqual(['bb', 'aa']);
    expect(changes()).toBe(2);
  });

  it('keeps the held files apart from the cached bytes', async () => {
    const { api, model } = setup();
    api.entryList = [
      makeEntry({ key: 'aa', bytes: 1, held_bytes: 500 }),
      makeEntry({ key: 'bb', bytes: 9 })
    ];
    await model.update();
    expect(model.status?.cached_bytes).toBe(10);
    expect(model.status?.held_bytes).toBe(500);
    expect(model.status?.held_files).toBe(1);
    model.sortBy = 'bytes';
    expect(model.entries.map(e => e.key)).toEqual(['aa', 'bb']);
  });

  it('treats a stopped daemon as a state, not an error', async () => {
    const { api, model } = setup();
    api.running = false;
    await model.update();
    expect(model.status?.running).toBe(false);
    expect(model.entries).toEqual([]);
    expect(model.error).toBeNull();
  });

  it('records why the server could not be reached, rejects, and recovers', async () => {
    const { api, model } = setup();
    api.failure = new Error('Failed to fetch');
    await expect(model.update()).rejects.toThrow('Failed to fetch');
    expect(model.error).toBe('Failed to fetch');
    api.failure = null;
    await model.update();
    expect(model.error).toBeNull();
  });
});

describe('OvermindModel actions', () => {
  it('evicts one entry and says so', async () => {
    const { api, model } = setup();
    api.entryList = [makeEntry({ key: 'aa', name: 'A()' }), makeEntry({ key: 'bb' })];
    await model.update();
    const done = model.evict('aa');
    expect(model.pending('aa')).toBe('evict');
    await done;
    expect(model.pending('aa')).toBeNull();
    expect(model.entries.map(e => e.key)).toEqual(['bb']);
    expect(api.entryList.map(e => e.key)).toEqual(['bb']);
    expect(model.notice).toEqual({ kind: 'info', text: 'Evicted A().' });
  });

  it('ignores a second click while the first action runs', async () => {
    const { api, model } = setup();
    api.entryList = [makeEntry({ key: 'aa' })];
    await model.update();
    await Promise.all([model.evict('aa'), model.evict('aa')]);
    expect(api.calls.filter(c => c.startsWith('evict'))).toEqual(['evict aa']);
  });

  it("shows the server's message when an action fails", async () => {
    const { api, model } = setup();
    api.entryList = [makeEntry({ key: 'aa' })];
    await model.update();
    api.entryList = [];
    await model.evict('aa');
    expect(model.notice).toEqual({
      kind: 'error',
      text: "Evict failed: no cache entry matches 'aa'"
    });
  });

  it('evicts everything', async () => {
    const { api, model } = setup();
    api.entryList = [makeEntry({ key: 'aa' }), makeEntry({ key: 'bb' })];
    await model.update();
    await model.evictAll();
    expect(model.entries).toEqual([]);
    expect(model.evictingAll).toBe(false);
    expect(model.notice?.text).toBe('Evicted 2 entries.');
  });

  it('starts the daemon', async () => {
    const { api, model } = setup();
    api.running = false;
    await model.update();
    await model.startDaemon();
    expect(model.starting).toBe(false);
    expect(model.status?.running).toBe(true);
    expect(api.calls).toContain('start');
  });
});

describe('OvermindModel refresh progress', () => {
  it('shows progress until the daemon reports the refresh done', async () => {
    const { api, model } = setup();
    api.entryList = [makeEntry({ key: 'aa', name: 'A()' })];
    await model.update();
    expect(model.hasRunningRefresh).toBe(false);

    await model.refresh('aa');
    expect(model.isRefreshing(model.entries[0])).toBe(true);
    expect(model.hasRunningRefresh).toBe(true);

    await model.update(); // still running in the daemon
    expect(model.isRefreshing(model.entries[0])).toBe(true);
    expect(model.notice).toBeNull();

    api.entryList[0].refresh = { state: 'done', message: '', started: 1_700_000_000 };
    await model.update();
    expect(model.isRefreshing(model.entries[0])).toBe(false);
    expect(model.hasRunningRefresh).toBe(false);
    expect(model.notice).toEqual({ kind: 'info', text: 'Refreshed A().' });
  });

  it("reports the daemon's message from the entry that replaced the old one", async () => {
    const { api, model } = setup();
    api.entryList = [makeEntry({ key: 'aa', name: 'A()' })];
    await model.update();
    await model.refresh('aa');
    api.entryList = [
      makeEntry({
        key: 'dd',
        name: 'A()',
        refresh: { state: 'done', message: 'refreshed in 2.0 s', started: 1, previous: 'aa' }
      })
    ];
    await model.update();
    expect(model.notice).toEqual({ kind: 'info', text: 'Refreshed A(): refreshed in 2.0 s' });
    expect(model.hasRunningRefresh).toBe(false);
  });

  it('counts a replaced entry (new key) as a finished refresh', async () => {
    const { api, model } = setup();
    api.entryList = [makeEntry({ key: 'aa', name: 'A()' })];
    await model.update();
    await model.refresh('aa');
    api.entryList = [makeEntry({ key: 'cc', name: 'A()' })];
    await model.update();
    expect(model.entries.map(e => e.key)).toEqual(['cc']);
    expect(model.hasRunningRefresh).toBe(false);
    expect(model.notice?.text).toBe('Refreshed A().');
  });

  it('reports a failed refresh with its reason', async () => {
    const { api, model } = setup();
    api.entryList = [makeEntry({ key: 'aa', name: 'A()' })];
    await model.update();
    await model.refresh('aa');
    api.entryList[0].refresh = {
      state: 'failed',
      message: 'OSError: no such directory',
      started: 1
    };
    await model.update();
    expect(model.notice).toEqual({
      kind: 'error',
      text: 'Refresh of A() failed: OSError: no such directory'
    });
    expect(model.hasRunningRefresh).toBe(false);
  });

  it('shows a refresh started elsewhere (another sidebar, the CLI) as running', async () => {
    const { api, model } = setup();
    api.entryList = [
      makeEntry({ key: 'aa', refresh: { state: 'running', message: 'loading', started: 5 } })
    ];
    await model.update();
    expect(model.isRefreshing(model.entries[0])).toBe(true);
    expect(model.hasRunningRefresh).toBe(true);
  });
});

describe('OvermindModel refresh of a call that cannot be replayed', () => {
  it('reports the eviction the daemon made instead of a refresh', async () => {
    const { api, model } = setup();
    api.entryList = [makeEntry({ key: 'aa', name: 'A()', replayable: false })];
    await model.update();
    // The daemon answers with a partial entry and evicts it.
    api.refresh = async (key: string) => {
      api.entryList = api.entryList.filter(e => e.key !== key);
      return {
        key,
        name: 'A()',
        replayable: false,
        refresh: { state: 'failed', message: 'cannot be replayed; evicted', started: null }
      } as unknown as ReturnType<MemoryAPI['find']>;
    };
    await model.refresh('aa');
    expect(model.notice).toEqual({
      kind: 'error',
      text: 'Refresh of A() failed: cannot be replayed; evicted'
    });
    expect(model.entries).toEqual([]);
    expect(model.hasRunningRefresh).toBe(false);
  });
});

/** {@link setup}, and a first poll that lists a zygote of pid `pid`. */
async function setupWithZygote(pid: number): Promise<ReturnType<typeof setup>> {
  const ctx = setup();
  ctx.api.zygoteList = [makeZygote({ pid })];
  await ctx.model.update();
  return ctx;
}

describe('OvermindModel warm-kernel zygotes', () => {
  afterEach(() => {
    jest.restoreAllMocks();
  });

  it('polls the zygotes with the status and entries', async () => {
    const { api, model } = setup();
    expect(model.zygotes).toEqual([]);
    api.zygoteList = [makeZygote({ pid: 11 })];
    await model.update();
    expect(model.zygotes.map(z => z.pid)).toEqual([11]);
    expect(api.calls).toEqual(['status', 'entries', 'zygotes']);
    api.zygoteList = [];
    await model.update();
    expect(model.zygotes).toEqual([]);
  });

  it('restarts: waits (and says so) until the replacement is listed', async () => {
    const { api, model } = await setupWithZygote(11);
    const done = model.restartZygotes();
    expect(model.restartingZygotes).toBe(true);
    await done;
    expect(api.calls).toContain('restart-zygotes');
    expect(model.restartingZygotes).toBe(false);
    // The old zygote left the list at once; the new one is still importing.
    expect(model.zygotes).toEqual([]);
    expect(model.awaitingZygote).toBe(true);
    expect(model.isReplaced(11)).toBe(true);
    expect(model.notice).toBeNull();
    api.bootReplacement(12);
    await model.update();
    expect(model.awaitingZygote).toBe(false);
    expect(model.isReplaced(11)).toBe(false);
    expect(model.zygotes.map(z => z.pid)).toEqual([12]);
    expect(model.notice).toEqual({ kind: 'info', text: 'Zygote restarted: now pid 12.' });
  });

  it('does not take the restarted zygote, still listed, for its replacement', async () => {
    const { api, model } = await setupWithZygote(11);
    await model.restartZygotes();
    api.zygoteList = [makeZygote({ pid: 11, retiring: 'replaced on request' })];
    await model.update();
    expect(model.awaitingZygote).toBe(true);
    expect(model.isReplaced(11)).toBe(true);
  });

  it('ignores a second click while the restart request runs', async () => {
    const { api, model } = await setupWithZygote(11);
    await Promise.all([model.restartZygotes(), model.restartZygotes()]);
    expect(api.calls.filter(c => c === 'restart-zygotes')).toHaveLength(1);
  });

  it('says when there was nothing to restart', async () => {
    const { model } = setup();
    await model.update();
    await model.restartZygotes();
    expect(model.awaitingZygote).toBe(false);
    expect(model.notice).toEqual({
      kind: 'info',
      text: 'No zygote was running: nothing to restart.'
    });
  });

  it("shows the server's message when the restart fails", async () => {
    const { api, model } = await setupWithZygote(11);
    api.failure = new Error('Forbidden');
    await model.restartZygotes();
    expect(model.awaitingZygote).toBe(false);
    expect(model.notice).toEqual({
      kind: 'error',
      text: 'Restart of the zygote failed: Forbidden'
    });
  });

  it('gives up waiting for a replacement that never comes, saying where to look', async () => {
    const { model } = await setupWithZygote(11);
    const now = Date.now();
    jest.spyOn(Date, 'now').mockReturnValue(now);
    await model.restartZygotes();
    expect(model.awaitingZygote).toBe(true);
    jest.spyOn(Date, 'now').mockReturnValue(now + ZYGOTE_RESTART_TIMEOUT_MS + 1);
    await model.update();
    expect(model.awaitingZygote).toBe(false);
    expect(model.notice?.kind).toBe('error');
    expect(model.notice?.text).toMatch(/^No new zygote after 5 min: .*zygote-\*\.log/);
  });
});
