import { IEntry, IOvermindAPI, IStatus, IZygote } from '../types';

/** An entry as the daemon would list it, with overrides. */
export function makeEntry(overrides: Partial<IEntry> = {}): IEntry {
  return {
    key: 'a1b2c3',
    name: "UNet2DConditionModel.from_pretrained('/models/sd/unet')",
    class: 'diffusers.models.unets.unet_2d_condition.UNet2DConditionModel',
    callable: 'diffusers.UNet2DConditionModel.from_pretrained',
    source: '/models/sd/unet',
    bytes: 3_438_167_536,
    shared_bytes: 0,
    held_bytes: 0,
    tensors: 686,
    created: 1_700_000_000,
    last_used: 1_700_000_100,
    hits: 3,
    cold_seconds: 4.2,
    store_seconds: 1.1,
    warm_seconds: [0.05, 0.03, 0.04],
    warm_median_seconds: 0.04,
    holders: [1234],
    replayable: true,
    refresh: { state: 'idle', message: '', started: null },
    ...overrides
  };
}

/** A zygote as `GET zygotes` would list it, with overrides. */
export function makeZygote(overrides: Partial<IZygote> = {}): IZygote {
  return {
    pid: 4321,
    identity: '0123456789abcdef',
    socket: '/tmp/overmind-test/zygote-0123456789abcdef.sock',
    python: '/venv/bin/python',
    preloaded: 2816,
    preload_roots: ['diffusers', 'ipykernel', 'torch', 'transformers'],
    failed: [],
    refusal: null,
    forks: 3,
    last_fork_ms: 23.4,
    kernels: 1,
    owners: [77],
    uptime_seconds: 600,
    retiring: null,
    rss_bytes: 734_003_200,
    pss_bytes: 402_653_184,
    ...overrides
  };
}

/**
 * An in-memory stand-in for the server extension, for driving the model: it keeps entries
 * and answers like the REST routes do (evicting an unknown key rejects with the server's
 * message).
 */
export class MemoryAPI implements IOvermindAPI {
  running = true;
  entryList: IEntry[] = [];
  zygoteList: IZygote[] = [];
  calls: string[] = [];
  /** When set, every call rejects with this error (the server is unreachable). */
  failure: Error | null = null;

  async status(): Promise<IStatus> {
    this.check('status');
    return {
      running: this.running,
      socket: '/tmp/overmind-test/daemon.sock',
      ...(this.running
        ? {
            pid: 42,
            uptime_seconds: 10,
            budget_bytes: 1000,
            cached_bytes: this.entryList.reduce((n, e) => n + e.bytes, 0),
            held_bytes: this.entryList.reduce((n, e) => n + (e.held_bytes ?? 0), 0),
            held_files: this.entryList.filter(e => (e.held_bytes ?? 0) > 0).length,
            refolding: 0,
            evicted_mapped_bytes: 0,
            entries: this.entryList.length
          }
        : {}),
      memory_total_bytes: 4000,
      memory_available_bytes: 3000
    };
  }

  async entries(): Promise<IEntry[]> {
    this.check('entries');
    return this.running ? this.entryList.map(e => ({ ...e })) : [];
  }

  async evict(key: string): Promise<string[]> {
    this.check(`evict ${key}`);
    this.find(key);
    this.entryList = this.entryList.filter(e => e.key !== key);
    return [key];
  }

  async evictAll(): Promise<string[]> {
    this.check('evict-all');
    const keys = this.entryList.map(e => e.key);
    this.entryList = [];
    return keys;
  }

  async refresh(key: string): Promise<IEntry> {
    this.check(`refresh ${key}`);
    const entry = this.find(key);
    entry.refresh = { state: 'running', message: '', started: 1_700_000_000 };
    return { ...entry };
  }

  async startDaemon(): Promise<IStatus> {
    this.check('start');
    this.running = true;
    return this.status();
  }

  async zygotes(): Promise<IZygote[]> {
    this.check('zygotes');
    return this.zygoteList.map(z => ({ ...z }));
  }

  /** Like the zygotes: each retires at once (unlisted); `bootReplacement` lists the new one. */
  async restartZygotes(): Promise<number[]> {
    this.check('restart-zygotes');
    const pids = this.zygoteList.map(z => z.pid);
    this.zygoteList = [];
    return pids;
  }

  bootReplacement(pid: number): void {
    this.zygoteList.push(makeZygote({ pid, forks: 0, last_fork_ms: null, kernels: 0 }));
  }

  find(key: string): IEntry {
    const entry = this.entryList.find(e => e.key === key);
    if (!entry) {
      throw new Error(`no cache entry matches '${key}'`);
    }
    return entry;
  }

  private check(call: string): void {
    this.calls.push(call);
    if (this.failure) {
      throw this.failure;
    }
  }
}
