/**
 * JSON shapes of the overmind-lab REST API (`<base_url>/overmind-lab/api/v1/`).
 *
 * They mirror the daemon's Status JSON and Entry JSON (docs/internals.md); fields the
 * daemon leaves out when it is down are optional.
 */

/** Progress of a background refresh of one entry. */
export interface IRefresh {
  state: 'idle' | 'running' | 'done' | 'failed';
  message: string;
  /** Epoch seconds, or null when no refresh ever ran. */
  started: number | null;
  /** On the entry a refresh stored: the key of the entry it replaced. */
  previous?: string;
}

/** One cached result, as `GET entries` lists it. */
export interface IEntry {
  /** Hex cache key; also the id in `entries/<key>/...` routes. */
  key: string;
  /** Human name of the call, e.g. `UNet2DConditionModel.from_pretrained('/m/unet')`. */
  name: string;
  /** Qualified class of the cached result. */
  class: string;
  /** Qualified callable that produced it. */
  callable: string;
  /** Main argument (usually the model path), or null. */
  source: string | null;
  /** Bytes of the entry's own segments: what it adds to the cache (and its budget). */
  bytes: number;
  /** Bytes referenced from other entries (e.g. a shared `vae=vae`). */
  shared_bytes: number;
  /**
   * Bytes of the user's own files (checkpoints) the entry holds open and serves without a
   * copy: not in `bytes`, nor in the budget (absent from older daemons).
   */
  held_bytes?: number;
  tensors: number;
  /** Epoch seconds. */
  created: number;
  /** Epoch seconds. */
  last_used: number;
  hits: number;
  /** Hits that verify mode found equal to a plain load (absent from older daemons). */
  verified?: number;
  cold_seconds: number | null;
  store_seconds: number | null;
  /** Recent warm load times, newest last. */
  warm_seconds: number[];
  /**
   * Median of `warm_seconds`, or null before the first warm load: the warm time shown,
   * and the speed-up is `cold_seconds` over it.
   */
  warm_median_seconds: number | null;
  /** Pids of the processes that map the entry now. */
  holders: number[];
  /** Whether the daemon can re-run the recorded call (refresh). */
  replayable: boolean;
  refresh: IRefresh;
}

/** `GET status`. */
export interface IStatus {
  running: boolean;
  socket: string;
  pid?: number;
  version?: string;
  started?: number;
  uptime_seconds?: number;
  budget_bytes?: number;
  /** What the cache adds (segments, copies): the sum of the entries' `bytes`, within budget. */
  cached_bytes?: number;
  /**
   * Bytes of the user's own files held open and served without a copy: not in `cached_bytes`
   * nor in the budget (absent from older daemons).
   */
  held_bytes?: number;
  /** How many of the user's files are held open. */
  held_files?: number;
  /** Held files still in small page-cache folios, made large in the background. */
  refolding?: number;
  evicted_mapped_bytes?: number;
  /** Where segments live: files in `cache_dir`, or memfds (the fallback tier). */
  tier?: 'file' | 'memfd';
  tier_reason?: string;
  cache_dir?: string | null;
  /** Bytes of segment files (and linked source files) on disk. */
  disk_bytes?: number;
  /** Bytes of memfd segments. */
  memfd_bytes?: number;
  /** Bytes of segments now in memory (page cache or shmem). */
  resident_bytes?: number;
  entries?: number;
  memory_total_bytes: number | null;
  memory_available_bytes: number | null;
  /** Set when the daemon answered but something was wrong. */
  error?: string;
  /** A daemon that accepts connections but does not reply (stopped or stuck); `pid` is its. */
  not_answering?: boolean;
}

/**
 * A warm-kernel zygote, as `GET zygotes` lists it (the objects of `overmind-lab kernel
 * status --json`): a process that imported torch, diffusers, transformers... once and
 * forks kernels.
 */
export interface IZygote {
  pid: number;
  /** Hash of the interpreter and its import-relevant environment. */
  identity: string;
  socket: string;
  python: string;
  /** How many third-party modules it imported (submodules included). */
  preloaded: number;
  /** Their top-level names (`torch`, `diffusers`, ...), sorted. */
  preload_roots: string[];
  /** Modules it could not preload, each with the reason. */
  failed: string[];
  /** Why it refuses to fork (threads, CUDA, zmq), or null when it forks. */
  refusal: string | null;
  /** Kernels forked so far. */
  forks: number;
  /** Duration of the last fork, or null before the first. */
  last_fork_ms: number | null;
  /** Forked kernels still running. */
  kernels: number;
  /** Pids of the Jupyter servers it serves. */
  owners: number[];
  uptime_seconds: number;
  /** Why it no longer forks (replaced), or null. */
  retiring: string | null;
  /** Memory of the zygote process (`/proc/<pid>/smaps_rollup`); absent when unreadable. */
  rss_bytes?: number;
  pss_bytes?: number;
}

/** Everything the sidebar needs from the server extension. */
export interface IOvermindAPI {
  status(): Promise<IStatus>;
  entries(): Promise<IEntry[]>;
  evict(key: string): Promise<string[]>;
  evictAll(): Promise<string[]>;
  refresh(key: string): Promise<IEntry>;
  startDaemon(): Promise<IStatus>;
  zygotes(): Promise<IZygote[]>;
  /** Pids of the zygotes asked to restart (each starts a replacement and retires). */
  restartZygotes(): Promise<number[]>;
}

/** How the entry list is ordered. */
export type SortKey = 'last_used' | 'bytes' | 'name' | 'hits' | 'speedup';
