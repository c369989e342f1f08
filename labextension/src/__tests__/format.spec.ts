import {
  entrySize,
  formatAgo,
  formatBytes,
  formatDuration,
  formatMilliseconds,
  formatSeconds,
  formatSpeedup,
  heldBytes,
  heldSummary,
  holdersLabel,
  memoryBar,
  plural,
  preloadSummary,
  shortName,
  sortEntries,
  sourceLabel,
  speedup,
  timingBar,
  zygoteState
} from '../format';
import { IStatus } from '../types';
import { makeEntry, makeZygote } from './fixtures';

describe('formatBytes', () => {
  it.each([
    [0, '0 B'],
    [1023, '1023 B'],
    [1024, '1 KiB'],
    [1536, '1.5 KiB'],
    [3_438_167_536, '3.2 GiB'],
    [12 * 1024 ** 3, '12 GiB'],
    [5 * 1024 ** 5, '5120 TiB']
  ])('%d -> %s', (bytes, text) => {
    expect(formatBytes(bytes)).toBe(text);
  });

  it('shows a dash for missing values', () => {
    expect(formatBytes(null)).toBe('–');
    expect(formatBytes(undefined)).toBe('–');
    expect(formatBytes(NaN)).toBe('–');
  });
});

describe('formatSeconds', () => {
  it.each([
    [0.0004, '<1 ms'],
    [0.0381, '38 ms'],
    [0.9994, '999 ms'],
    [4.23, '4.2 s'],
    [12.6, '13 s'],
    [125, '2 min 5 s'],
    [7260, '2 h 1 min']
  ])('%d -> %s', (seconds, text) => {
    expect(formatSeconds(seconds)).toBe(text);
  });

  it('shows a dash for null', () => {
    expect(formatSeconds(null)).toBe('–');
  });
});

describe('formatDuration', () => {
  it.each([
    [0, '0 s'],
    [42.9, '42 s'],
    [185, '3 min 5 s'],
    [3600, '1 h'],
    [7620, '2 h 7 min'],
    [3 * 86400 + 4 * 3600 + 59, '3 d 4 h']
  ])('%d -> %s', (seconds, text) => {
    expect(formatDuration(seconds)).toBe(text);
  });
});

describe('formatAgo', () => {
  const now = 1_700_000_000_000;
  it.each([
    [now / 1000 - 3, 'just now'],
    [now / 1000 + 5, 'just now'],
    [now / 1000 - 45, '45 s ago'],
    [now / 1000 - 300, '5 min ago'],
    [now / 1000 - 7300, '2 h ago'],
    [now / 1000 - 3 * 86400, '3 d ago']
  ])('%d -> %s', (epoch, text) => {
    expect(formatAgo(epoch, now)).toBe(text);
  });
});

describe('speed-up', () => {
  it("is cold seconds over the daemon's median warm seconds", () => {
    expect(
      speedup(makeEntry({ cold_seconds: 4, warm_seconds: [0.1, 0.04, 0.05], warm_median_seconds: 0.05 }))
    ).toBe(80);
  });

  it('is unknown before the first warm load, or without a cold time', () => {
    expect(speedup(makeEntry({ warm_seconds: [], warm_median_seconds: null }))).toBeNull();
    expect(speedup(makeEntry({ cold_seconds: null }))).toBeNull();
    expect(speedup(makeEntry({ warm_seconds: [0], warm_median_seconds: 0 }))).toBeNull();
  });

  it('formats factors', () => {
    expect(formatSpeedup(110.4)).toBe('110×');
    expect(formatSpeedup(3.14)).toBe('3.1×');
    expect(formatSpeedup(2)).toBe('2×');
    expect(formatSpeedup(0.25)).toBe('0.25×'); // a warm load slower than the cold one
    expect(formatSpeedup(0.0333)).toBe('0.033×');
    expect(formatSpeedup(null)).toBe('–');
  });
});

describe('timingBar', () => {
  it('scales both bars to the longer time', () => {
    const bar = timingBar(
      makeEntry({ cold_seconds: 4, warm_seconds: [1, 1, 1], warm_median_seconds: 1 })
    );
    expect(bar.cold).toBe(1);
    expect(bar.warm).toBe(0.25);
    expect(bar.speedup).toBe(4);
  });

  it('keeps a sliver visible for a very fast warm load', () => {
    const bar = timingBar(
      makeEntry({ cold_seconds: 100, warm_seconds: [0.001], warm_median_seconds: 0.001 })
    );
    expect(bar.warm).toBe(0.01);
  });

  it('has no warm bar before a warm load', () => {
    const bar = timingBar(
      makeEntry({ cold_seconds: 4, warm_seconds: [], warm_median_seconds: null })
    );
    expect(bar).toEqual({ cold: 1, warm: 0, coldSeconds: 4, warmSeconds: null, speedup: null });
  });
});

describe('memoryBar', () => {
  const gib = 1024 ** 3;
  const running: IStatus = {
    running: true,
    socket: '/tmp/s',
    cached_bytes: 8 * gib,
    budget_bytes: 32 * gib,
    memory_total_bytes: 64 * gib,
    memory_available_bytes: 40 * gib
  };

  it('splits system memory into cache, others and free, with the budget mark', () => {
    expect(memoryBar(running)).toEqual({
      cached: 0.125,
      other: 0.25,
      budget: 0.5,
      overBudget: false
    });
  });

  it('flags a cache over its budget', () => {
    expect(memoryBar({ ...running, cached_bytes: 33 * gib }).overBudget).toBe(true);
  });

  it('shows only system memory when the daemon is down', () => {
    const down: IStatus = {
      running: false,
      socket: '/tmp/s',
      memory_total_bytes: 64 * gib,
      memory_available_bytes: 48 * gib
    };
    expect(memoryBar(down)).toEqual({ cached: 0, other: 0.25, budget: null, overBudget: false });
  });

  it('leaves held files out: the bar and the budget are about the cache alone', () => {
    // The user's own files held open cost no budget: 40 GiB held over a 32 GiB budget.
    const holding: IStatus = { ...running, held_bytes: 40 * gib, held_files: 3, refolding: 1 };
    expect(memoryBar(holding)).toEqual(memoryBar(running));
    expect(memoryBar(holding).overBudget).toBe(false);
    expect(memoryBar({ ...holding, cached_bytes: 33 * gib }).overBudget).toBe(true);
  });

  it('survives missing memory numbers', () => {
    const bare: IStatus = {
      running: false,
      socket: '/tmp/s',
      memory_total_bytes: null,
      memory_available_bytes: null
    };
    expect(memoryBar(bare)).toEqual({ cached: 0, other: 0, budget: null, overBudget: false });
  });
});

describe('held files', () => {
  const gib = 1024 ** 3;
  const status: IStatus = {
    running: true,
    socket: '/tmp/s',
    cached_bytes: 1024 ** 2,
    budget_bytes: 4 * gib,
    held_bytes: 5.2 * gib,
    held_files: 3,
    refolding: 0,
    memory_total_bytes: 64 * gib,
    memory_available_bytes: 40 * gib
  };

  it('counts held bytes, as 0 from an older daemon', () => {
    expect(heldBytes({ held_bytes: 7 })).toBe(7);
    expect(heldBytes({ held_bytes: 0 })).toBe(0);
    expect(heldBytes({})).toBe(0);
    expect(heldBytes({ held_bytes: NaN })).toBe(0);
  });

  it('shows what the daemon holds of your own files, apart from the budget', () => {
    const held = heldSummary(status);
    expect(held?.label).toBe('held: 5.2 GiB of your own files');
    expect(held?.title).toBe(
      'Your checkpoint files (3), held open and served without a copy; not counted in the budget'
    );
  });

  it('says when held files are still being refolded', () => {
    const held = heldSummary({ ...status, refolding: 2 });
    expect(held?.title).toMatch(/not counted in the budget\n2 still in small page-cache folios/);
  });

  it('shows nothing when nothing is held, the daemon is down, or too old to say', () => {
    expect(heldSummary({ ...status, held_bytes: 0, held_files: 0 })).toBeNull();
    const { held_bytes: _b, held_files: _f, refolding: _r, ...older } = status;
    expect(heldSummary(older)).toBeNull();
    expect(heldSummary({ ...status, running: false })).toBeNull();
  });

  it("shows an entry's held bytes apart from its size", () => {
    const size = entrySize(
      makeEntry({ bytes: 1.2 * 1024 ** 2, shared_bytes: 0, held_bytes: 1.7 * gib, tensors: 686 })
    );
    expect(size.cached).toBe(1.2 * 1024 ** 2);
    expect(formatBytes(size.cached)).toBe('1.2 MiB');
    expect(size.held).toBe(1.7 * gib);
    expect(size.heldLabel).toBe('+ 1.7 GiB held');
    expect(size.title).toBe(
      '686 tensors\n+ 1.7 GiB held: your checkpoint files, held open and served without a ' +
        'copy; not counted in the budget'
    );
  });

  it('keeps the split with shared entries in the title', () => {
    const size = entrySize(
      makeEntry({ bytes: 1024 ** 2, shared_bytes: 3 * 1024 ** 2, held_bytes: 2 * gib })
    );
    expect(size.cached).toBe(4 * 1024 ** 2);
    expect(size.title).toMatch(/^1 MiB own \+ 3 MiB shared with other entries\n\+ 2 GiB held: /);
  });

  it('shows no held part when an entry holds none, or the daemon is too old to say', () => {
    for (const held_bytes of [0, undefined]) {
      const size = entrySize(makeEntry({ bytes: 10, shared_bytes: 5, held_bytes }));
      expect(size).toEqual({
        cached: 15,
        held: 0,
        heldLabel: null,
        title: '10 B own + 5 B shared with other entries'
      });
    }
    expect(entrySize(makeEntry({ held_bytes: undefined })).title).toBe('686 tensors');
  });
});

describe('names', () => {
  it('shortens a call to its callable', () => {
    expect(shortName(makeEntry())).toBe('UNet2DConditionModel.from_pretrained');
    expect(shortName(makeEntry({ name: '', callable: 'mod.load' }))).toBe('mod.load');
  });

  it('labels a source by its last path component', () => {
    expect(sourceLabel('/models/sd/unet/')).toBe('unet');
    expect(sourceLabel('runwayml/stable-diffusion-v1-5')).toBe('stable-diffusion-v1-5');
    expect(sourceLabel('tiny')).toBe('tiny');
    expect(sourceLabel(null)).toBe('');
  });

  it('counts holders', () => {
    expect(holdersLabel([])).toBe('no process');
    expect(holdersLabel([12])).toBe('1 process');
    expect(holdersLabel([12, 13])).toBe('2 processes');
  });
});

describe('sortEntries', () => {
  const a = makeEntry({ key: 'aa', name: 'b', bytes: 10, hits: 5, last_used: 30 });
  const b = makeEntry({ key: 'bb', name: 'a', bytes: 30, hits: 1, last_used: 10 });
  const c = makeEntry({
    key: 'cc',
    name: 'c',
    bytes: 5,
    shared_bytes: 100,
    hits: 9,
    last_used: 20,
    warm_seconds: [],
    warm_median_seconds: null
  });

  it.each([
    ['last_used', ['aa', 'cc', 'bb']],
    ['bytes', ['cc', 'bb', 'aa']],
    ['name', ['bb', 'aa', 'cc']],
    ['hits', ['cc', 'aa', 'bb']],
    ['speedup', ['aa', 'bb', 'cc']]
  ] as const)('by %s', (by, keys) => {
    expect(sortEntries([a, b, c], by).map(e => e.key)).toEqual(keys);
  });

  it('sorts by size with the held files: a large model held open sorts as large', () => {
    const held = makeEntry({ key: 'dd', bytes: 1, shared_bytes: 0, held_bytes: 1000 });
    const older = makeEntry({ key: 'ee', bytes: 20, held_bytes: undefined });
    expect(sortEntries([a, b, c, held, older], 'bytes').map(e => e.key)).toEqual([
      'dd',
      'cc',
      'bb',
      'ee',
      'aa'
    ]);
  });

  it('breaks ties by key and leaves the input alone', () => {
    const input = [makeEntry({ key: 'zz' }), makeEntry({ key: 'mm' })];
    expect(sortEntries(input, 'hits').map(e => e.key)).toEqual(['mm', 'zz']);
    expect(input.map(e => e.key)).toEqual(['zz', 'mm']);
  });
});

describe('warm-kernel zygotes', () => {
  it('formats fork times in milliseconds', () => {
    expect(formatMilliseconds(23.6)).toBe('24 ms');
    expect(formatMilliseconds(3.14)).toBe('3.1 ms');
    expect(formatMilliseconds(0.04)).toBe('0 ms');
    expect(formatMilliseconds(null)).toBe('–');
  });

  it('counts in words', () => {
    expect(plural(1, 'fork')).toBe('1 fork');
    expect(plural(0, 'fork')).toBe('0 forks');
    expect(plural(2, 'process', 'processes')).toBe('2 processes');
  });

  it('summarizes the preloaded modules with their packages', () => {
    expect(preloadSummary(makeZygote({ preloaded: 2816, preload_roots: ['diffusers', 'torch'] })))
      .toBe('2816 modules imported from 2 packages: diffusers, torch');
    expect(preloadSummary(makeZygote({ preloaded: 1, preload_roots: [] }))).toBe(
      '1 module imported'
    );
  });

  it('is ready, not forking (with why), or restarting', () => {
    expect(zygoteState(makeZygote()).kind).toBe('ready');
    const refusing = zygoteState(makeZygote({ refusal: 'CUDA is initialized' }));
    expect(refusing).toMatchObject({ kind: 'refusing', label: 'not forking' });
    expect(refusing.detail).toContain('CUDA is initialized');
    const retiring = zygoteState(makeZygote({ retiring: 'replaced on request' }));
    expect(retiring).toMatchObject({ kind: 'restarting', label: 'restarting' });
    expect(retiring.detail).toMatch(/^replaced on request: /);
    // Asked to restart by this sidebar, before the zygote says it retires.
    expect(zygoteState(makeZygote(), true).kind).toBe('restarting');
    // A restart wins over an old refusal: the replacement is the fix.
    expect(zygoteState(makeZygote({ refusal: 'threads' }), true).kind).toBe('restarting');
  });
});
