/**
 * Pure formatting and ordering for the sidebar: no DOM, no JupyterLab imports, so jest
 * tests it directly.
 */

import { IEntry, IStatus, IZygote, SortKey } from './types';

const BINARY_UNITS = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];

/** `1536 -> '1.5 KiB'`: binary units, three significant digits (as `overmind-lab status`). */
export function formatBytes(bytes: number | null | undefined): string {
  if (bytes === null || bytes === undefined || !Number.isFinite(bytes)) {
    return '–';
  }
  let value = bytes;
  for (const unit of BINARY_UNITS) {
    if (Math.abs(value) < 1024 || unit === 'TiB') {
      return unit === 'B'
        ? `${Math.round(value)} B`
        : `${Number(value.toPrecision(3))} ${unit}`;
    }
    value /= 1024;
  }
  throw new Error('unreachable');
}

/** A load time: `0.0381 -> '38 ms'`, `4.23 -> '4.2 s'`, `125 -> '2 min 5 s'`. */
export function formatSeconds(seconds: number | null | undefined): string {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) {
    return '–';
  }
  if (seconds < 0.001) {
    return '<1 ms';
  }
  if (seconds < 1) {
    return `${Math.round(seconds * 1000)} ms`;
  }
  if (seconds < 10) {
    return `${Number(seconds.toFixed(1))} s`;
  }
  if (seconds < 60) {
    return `${Math.round(seconds)} s`;
  }
  return formatDuration(seconds);
}

/** A span of time such as an uptime: `'42 s'`, `'3 min 5 s'`, `'2 h 7 min'`, `'3 d 4 h'`. */
export function formatDuration(seconds: number | null | undefined): string {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) {
    return '–';
  }
  const s = Math.max(0, Math.floor(seconds));
  const parts: [number, string][] = [
    [Math.floor(s / 86400), 'd'],
    [Math.floor((s % 86400) / 3600), 'h'],
    [Math.floor((s % 3600) / 60), 'min'],
    [s % 60, 's']
  ];
  const first = parts.findIndex(([n]) => n > 0);
  if (first === -1) {
    return '0 s';
  }
  return parts
    .slice(first, first + 2)
    .filter(([n]) => n > 0)
    .map(([n, unit]) => `${n} ${unit}`)
    .join(' ');
}

/** How long ago an epoch-seconds time was: `'just now'`, `'5 min ago'`, `'2 d ago'`. */
export function formatAgo(epochSeconds: number, nowMs: number = Date.now()): string {
  const ago = nowMs / 1000 - epochSeconds;
  if (!Number.isFinite(ago)) {
    return '–';
  }
  if (ago < 10) {
    return 'just now';
  }
  if (ago < 60) {
    return `${Math.floor(ago)} s ago`;
  }
  if (ago < 3600) {
    return `${Math.floor(ago / 60)} min ago`;
  }
  if (ago < 86400) {
    return `${Math.floor(ago / 3600)} h ago`;
  }
  return `${Math.floor(ago / 86400)} d ago`;
}

/**
 * Cold load time over the median warm load time, or null before the first warm load.
 * The daemon computes the median (`warm_median_seconds`), so the CLI, the ipywidgets
 * panel and this sidebar all show the same number.
 */
export function speedup(
  entry: Pick<IEntry, 'cold_seconds' | 'warm_median_seconds'>
): number | null {
  const warm = entry.warm_median_seconds;
  const cold = entry.cold_seconds;
  if (warm === null || cold === null || !(warm > 0) || !(cold > 0)) {
    return null;
  }
  return cold / warm;
}

/** `110.4 -> '110×'`, `3.14 -> '3.1×'`; a warm load slower than the cold one keeps two
 * significant digits (`0.033 -> '0.033×'`), never `'0×'`, as the CLI does. */
export function formatSpeedup(factor: number | null): string {
  if (factor === null || !Number.isFinite(factor)) {
    return '–';
  }
  if (factor >= 10) {
    return `${Math.round(factor)}×`;
  }
  return factor >= 1 ? `${Number(factor.toFixed(1))}×` : `${Number(factor.toPrecision(2))}×`;
}

/** Widths (0..1) of the cold and warm bars of an entry's timing bar. */
export interface ITimingBar {
  cold: number;
  warm: number;
  coldSeconds: number | null;
  warmSeconds: number | null;
  speedup: number | null;
}

/** Cold against median warm, scaled to the longer of the two. */
export function timingBar(
  entry: Pick<IEntry, 'cold_seconds' | 'warm_median_seconds'>
): ITimingBar {
  const cold = entry.cold_seconds !== null && entry.cold_seconds > 0 ? entry.cold_seconds : null;
  const warm = entry.warm_median_seconds;
  const longest = Math.max(cold ?? 0, warm ?? 0);
  const width = (s: number | null): number =>
    s === null || longest <= 0 ? 0 : Math.max(0.01, Math.min(1, s / longest));
  return {
    cold: width(cold),
    warm: width(warm),
    coldSeconds: cold,
    warmSeconds: warm,
    speedup: speedup(entry)
  };
}

/** Shares (0..1) of system memory for the header's memory bar. */
export interface IMemoryBar {
  /** The cache's own bytes (`cached_bytes`); held files are not in it, nor in the budget. */
  cached: number;
  /** Memory in use by everything else. */
  other: number;
  /** Where the cache budget ends. */
  budget: number | null;
  /** Whether the cache holds more than its budget (it evicts on the next store). */
  overBudget: boolean;
}

const clamp01 = (x: number): number => Math.max(0, Math.min(1, x));

/** The memory bar is scaled to system memory: [cache | others | available], budget mark. */
export function memoryBar(status: IStatus): IMemoryBar {
  const total = status.memory_total_bytes ?? 0;
  const available = status.memory_available_bytes ?? total;
  const cachedBytes = status.running ? status.cached_bytes ?? 0 : 0;
  const budgetBytes = status.running ? status.budget_bytes ?? null : null;
  if (!(total > 0)) {
    return { cached: 0, other: 0, budget: null, overBudget: false };
  }
  const cached = clamp01(cachedBytes / total);
  const used = clamp01((total - available) / total);
  return {
    cached,
    other: clamp01(used - cached),
    budget: budgetBytes === null ? null : clamp01(budgetBytes / total),
    overBudget: budgetBytes !== null && cachedBytes > budgetBytes
  };
}

/** Why held files are shown apart from the cache: the tooltip of each "held" number. */
export const HELD_EXPLAINED = 'held open and served without a copy; not counted in the budget';

/** Bytes of the user's own files held open (status or entry); 0 from older daemons. */
export function heldBytes(x: { held_bytes?: number }): number {
  const held = x.held_bytes;
  return held !== undefined && Number.isFinite(held) && held > 0 ? held : 0;
}

/** The memory area's line about held files, with its tooltip. */
export interface IHeldSummary {
  /** `'held: 5.2 GiB of your own files'`. */
  label: string;
  title: string;
}

/**
 * The user's own files the daemon holds, shown apart from the cache and its budget; null
 * when it holds none, is down, or is too old to say.
 */
export function heldSummary(
  status: Pick<IStatus, 'running' | 'held_bytes' | 'held_files' | 'refolding'>
): IHeldSummary | null {
  const held = status.running ? heldBytes(status) : 0;
  if (held === 0) {
    return null;
  }
  const files = status.held_files ?? 0;
  const refolding = status.refolding ?? 0;
  return {
    label: `held: ${formatBytes(held)} of your own files`,
    title:
      `Your checkpoint files${files > 0 ? ` (${files})` : ''}, ${HELD_EXPLAINED}` +
      (refolding > 0
        ? `\n${refolding} still in small page-cache folios, being made large in the background`
        : '')
  };
}

/** How an entry's size is shown: the cache's bytes, and the user's files it holds apart. */
export interface IEntrySize {
  /** What the entry costs the cache: own plus shared bytes (the size shown). */
  cached: number;
  /** Bytes of the user's own files it holds open (0: none, or an older daemon). */
  held: number;
  /** `'+ 1.7 GiB held'`, or null when it holds none. */
  heldLabel: string | null;
  /** Tooltip: how the size splits. */
  title: string;
}

/** `1.2 MiB` in the cache `+ 1.7 GiB held` apart; the title says how the size splits. */
export function entrySize(
  entry: Pick<IEntry, 'bytes' | 'shared_bytes' | 'held_bytes' | 'tensors'>
): IEntrySize {
  const held = heldBytes(entry);
  const split =
    entry.shared_bytes > 0
      ? `${formatBytes(entry.bytes)} own + ${formatBytes(entry.shared_bytes)} shared with ` +
        'other entries'
      : `${entry.tensors} tensors`;
  return {
    cached: entry.bytes + entry.shared_bytes,
    held,
    heldLabel: held > 0 ? `+ ${formatBytes(held)} held` : null,
    title:
      held > 0
        ? `${split}\n+ ${formatBytes(held)} held: your checkpoint files, ${HELD_EXPLAINED}`
        : split
  };
}

/** The short name of a call: `'UNet2DConditionModel.from_pretrained'` from its `name`. */
export function shortName(entry: Pick<IEntry, 'name' | 'callable'>): string {
  const paren = entry.name.indexOf('(');
  const head = paren > 0 ? entry.name.slice(0, paren) : entry.name;
  return head || entry.callable;
}

/** Last path component of an entry's source (`'/m/sd/unet' -> 'unet'`), or ''. */
export function sourceLabel(source: string | null): string {
  if (!source) {
    return '';
  }
  const trimmed = source.replace(/\/+$/, '');
  const slash = trimmed.lastIndexOf('/');
  return slash >= 0 && slash < trimmed.length - 1 ? trimmed.slice(slash + 1) : trimmed;
}

/** What sorting by size compares: the cache's bytes and the user's files held, together. */
function sortSize(entry: IEntry): number {
  return entry.bytes + entry.shared_bytes + heldBytes(entry);
}

const COMPARATORS: Record<SortKey, (a: IEntry, b: IEntry) => number> = {
  last_used: (a, b) => b.last_used - a.last_used,
  bytes: (a, b) => sortSize(b) - sortSize(a),
  name: (a, b) => a.name.localeCompare(b.name),
  hits: (a, b) => b.hits - a.hits,
  speedup: (a, b) => (speedup(b) ?? -1) - (speedup(a) ?? -1)
};

/** A sorted copy; ties keep a stable order by key, so rows don't jump between polls. */
export function sortEntries(entries: readonly IEntry[], by: SortKey): IEntry[] {
  const cmp = COMPARATORS[by];
  return [...entries].sort((a, b) => cmp(a, b) || a.key.localeCompare(b.key));
}

/** `'1 process'`, `'3 processes'`, `'no process'`. */
export function holdersLabel(holders: readonly number[]): string {
  if (holders.length === 0) {
    return 'no process';
  }
  return holders.length === 1 ? '1 process' : `${holders.length} processes`;
}

/** `'1 fork'`, `'3 forks'`; `many` for irregular plurals. */
export function plural(n: number, one: string, many = `${one}s`): string {
  return `${n} ${n === 1 ? one : many}`;
}

/** A short time in milliseconds, such as a fork: `3.14 -> '3.1 ms'`, `23.6 -> '24 ms'`. */
export function formatMilliseconds(ms: number | null | undefined): string {
  if (ms === null || ms === undefined || !Number.isFinite(ms)) {
    return '–';
  }
  return ms < 10 ? `${Number(ms.toFixed(1))} ms` : `${Math.round(ms)} ms`;
}

/** What a zygote is doing, for its row: a label, a kind (for the colour) and why. */
export interface IZygoteState {
  kind: 'ready' | 'refusing' | 'restarting';
  label: string;
  /** The zygote's own reason (refusal, retiring), or what the state means. */
  detail: string;
}

/**
 * A zygote's state. `restarting` is true when this sidebar asked it to restart: it then
 * stops forking at once, but is listed until its replacement has imported everything.
 */
export function zygoteState(
  zygote: Pick<IZygote, 'refusal' | 'retiring'>,
  restarting = false
): IZygoteState {
  if (zygote.retiring || restarting) {
    return {
      kind: 'restarting',
      label: 'restarting',
      detail:
        `${zygote.retiring ?? 'restart requested'}: a replacement is importing the ` +
        'libraries (kernels launched meanwhile start plainly); running kernels keep working'
    };
  }
  if (zygote.refusal) {
    return {
      kind: 'refusing',
      label: 'not forking',
      detail: `Refuses to fork (${zygote.refusal}): kernels start plainly. Restart it.`
    };
  }
  return { kind: 'ready', label: 'ready', detail: 'Forks a warm kernel on each launch or restart' };
}

/** What a zygote preloaded: `'1234 modules imported from 3 packages: diffusers, torch, …'`. */
export function preloadSummary(zygote: Pick<IZygote, 'preloaded' | 'preload_roots'>): string {
  const roots = zygote.preload_roots;
  return (
    `${plural(zygote.preloaded, 'module')} imported` +
    (roots.length ? ` from ${plural(roots.length, 'package')}: ${roots.join(', ')}` : '')
  );
}
