/**
 * React view of the sidebar. State lives in {@link OvermindModel}; these components only
 * draw it and forward clicks.
 */

import { closeIcon, deleteIcon, LabIcon, refreshIcon } from '@jupyterlab/ui-components';
import * as React from 'react';

import {
  entrySize,
  formatAgo,
  formatBytes,
  formatDuration,
  formatMilliseconds,
  formatSeconds,
  formatSpeedup,
  heldSummary,
  holdersLabel,
  memoryBar,
  plural,
  preloadSummary,
  shortName,
  sourceLabel,
  timingBar,
  zygoteState
} from './format';
import { overmindIcon } from './icons';
import { OvermindModel } from './model';
import { IEntry, IStatus, IZygote, SortKey } from './types';

const SORT_LABELS: Record<SortKey, string> = {
  last_used: 'Last used',
  bytes: 'Size',
  name: 'Name',
  hits: 'Hits',
  speedup: 'Speed-up'
};

export interface IPanelProps {
  model: OvermindModel;
  /** Asks the user to confirm evict-all (a dialog); resolves true to go ahead. */
  confirmEvictAll: () => Promise<boolean>;
}

/** Re-render on every `model.changed`. */
function useModel(model: OvermindModel): void {
  const [, setTick] = React.useState(0);
  React.useEffect(() => {
    const onChange = (): void => setTick(t => t + 1);
    model.changed.connect(onChange);
    return () => {
      model.changed.disconnect(onChange);
    };
  }, [model]);
}

export function OvermindPanel({ model, confirmEvictAll }: IPanelProps): JSX.Element {
  useModel(model);
  const status = model.status;
  const entries = model.entries;
  const onEvictAll = async (): Promise<void> => {
    if (await confirmEvictAll()) {
      await model.evictAll();
    }
  };
  return (
    <div className="jp-OvermindLab-panel">
      <header className="jp-OvermindLab-header">
        <h2 className="jp-OvermindLab-title">Model cache</h2>
        <DaemonState model={model} status={status} />
        {status && <MemoryBar status={status} />}
      </header>
      {model.error && (
        <div className="jp-OvermindLab-error" role="alert">
          Cannot reach the overmind-lab server extension: {model.error}
        </div>
      )}
      {model.notice && (
        <div
          className={`jp-OvermindLab-notice jp-OvermindLab-notice-${model.notice.kind}`}
          role={model.notice.kind === 'error' ? 'alert' : 'status'}
        >
          <span className="jp-OvermindLab-noticeText">{model.notice.text}</span>
          <IconButton
            icon={closeIcon}
            label="Dismiss message"
            onClick={() => model.dismissNotice()}
          />
        </div>
      )}
      {entries.length > 0 && (
        <div className="jp-OvermindLab-toolbar">
          <label className="jp-OvermindLab-sort">
            Sort by{' '}
            <select
              className="jp-OvermindLab-select"
              value={model.sortBy}
              onChange={event => {
                model.sortBy = event.target.value as SortKey;
              }}
            >
              {(Object.keys(SORT_LABELS) as SortKey[]).map(key => (
                <option key={key} value={key}>
                  {SORT_LABELS[key]}
                </option>
              ))}
            </select>
          </label>
          <button
            type="button"
            className="jp-Button jp-mod-styled jp-mod-warn jp-OvermindLab-evictAll"
            aria-label="Evict all cached models"
            title="Evict every cached model (asks first)"
            disabled={model.evictingAll}
            onClick={() => void onEvictAll()}
          >
            {model.evictingAll ? 'Evicting…' : 'Evict all'}
          </button>
        </div>
      )}
      {entries.length > 0 ? (
        <ul className="jp-OvermindLab-entries" aria-label="Cached models">
          {entries.map(entry => (
            <EntryRow key={entry.key} entry={entry} model={model} />
          ))}
        </ul>
      ) : (
        status && <EmptyState running={status.running} />
      )}
      {status && <WarmKernels model={model} />}
    </div>
  );
}

/** The warm-kernel zygotes: what each preloaded, what it costs, what it served. */
function WarmKernels({ model }: { model: OvermindModel }): JSX.Element {
  const zygotes = model.zygotes;
  const busy = model.restartingZygotes || model.awaitingZygote;
  return (
    <section className="jp-OvermindLab-warm" aria-label="Warm kernels">
      <div className="jp-OvermindLab-sectionHeader">
        <h3 className="jp-OvermindLab-title">Warm kernels</h3>
        {(zygotes.length > 0 || busy) && (
          <button
            type="button"
            className="jp-Button jp-mod-styled jp-OvermindLab-restart"
            aria-label="Restart the warm-kernel zygote"
            title={
              'Import the libraries again in a new zygote (after an upgrade); running ' +
              'kernels keep working'
            }
            disabled={busy}
            onClick={() => void model.restartZygotes()}
          >
            {busy ? 'Restarting…' : 'Restart'}
          </button>
        )}
      </div>
      {zygotes.length > 0 ? (
        <ul className="jp-OvermindLab-zygotes" aria-label="Zygotes">
          {zygotes.map(z => (
            <ZygoteRow key={z.pid} zygote={z} restarting={model.isReplaced(z.pid)} />
          ))}
        </ul>
      ) : model.awaitingZygote ? (
        <div className="jp-OvermindLab-refreshing">
          <div
            className="jp-OvermindLab-progress"
            role="progressbar"
            aria-label="Restarting the zygote"
            aria-busy="true"
          />
          <span>A new zygote is importing the libraries…</span>
        </div>
      ) : (
        <div className="jp-OvermindLab-warmEmpty">
          <p>
            No zygote is running. Kernels forked from one start with torch, diffusers and
            transformers already imported. Install the kernel:
          </p>
          <pre className="jp-OvermindLab-code">overmind-lab kernel install --sys-prefix</pre>
          <p>
            then pick <strong>Python 3 (warm, overmind-lab)</strong> for a notebook. Its first
            launch starts the zygote.
          </p>
        </div>
      )}
    </section>
  );
}

function ZygoteRow({ zygote, restarting }: { zygote: IZygote; restarting: boolean }): JSX.Element {
  const state = zygoteState(zygote, restarting);
  const modules = preloadSummary(zygote);
  return (
    <li
      className={`jp-OvermindLab-zygote jp-mod-${state.kind}`}
      data-pid={zygote.pid}
      aria-label={`Zygote pid ${zygote.pid}, ${state.label}`}
    >
      <div className="jp-OvermindLab-zygoteHead">
        <span className="jp-OvermindLab-dot" aria-hidden="true" />
        <span className="jp-OvermindLab-zygoteName" title={`${zygote.python}\n${zygote.socket}`}>
          Zygote · pid <span className="jp-OvermindLab-zygotePid">{zygote.pid}</span>
        </span>
        <span className="jp-OvermindLab-zygoteState" title={state.detail}>
          {state.label}
        </span>
      </div>
      <div className="jp-OvermindLab-entryStats">
        <span
          className="jp-OvermindLab-zygoteMemory"
          title="RSS: memory the zygote maps; PSS: its share, with the pages its kernels share counted once"
        >
          RSS {formatBytes(zygote.rss_bytes)} · PSS {formatBytes(zygote.pss_bytes)}
        </span>
        <span className="jp-OvermindLab-zygoteForks" title="Kernels forked from it">
          {plural(zygote.forks, 'fork')}
        </span>
        <span className="jp-OvermindLab-zygoteLastFork" title="How long the last fork took">
          last fork {formatMilliseconds(zygote.last_fork_ms)}
        </span>
        <span title="Forked kernels still running">{plural(zygote.kernels, 'kernel')} running</span>
        <span>up {formatDuration(zygote.uptime_seconds)}</span>
      </div>
      <details className="jp-OvermindLab-modules">
        <summary title={modules}>{plural(zygote.preloaded, 'module')} preloaded</summary>
        <div className="jp-OvermindLab-moduleList">{zygote.preload_roots.join(', ')}</div>
      </details>
      {zygote.refusal && (
        <div className="jp-OvermindLab-refreshFailed" role="alert">
          Not forking: {zygote.refusal}
        </div>
      )}
      {zygote.failed.length > 0 && (
        <div className="jp-OvermindLab-zygoteFailed" title={zygote.failed.join('\n')}>
          Not preloaded: {zygote.failed.map(f => f.split(':')[0]).join(', ')}
        </div>
      )}
    </li>
  );
}

function DaemonState({
  model,
  status
}: {
  model: OvermindModel;
  status: IStatus | null;
}): JSX.Element {
  if (status === null) {
    return <div className="jp-OvermindLab-daemon">Connecting…</div>;
  }
  if (status.not_answering) {
    return (
      <div className="jp-OvermindLab-daemon jp-OvermindLab-daemon-down" title={status.error}>
        <span className="jp-OvermindLab-dot" aria-hidden="true" />
        <span className="jp-OvermindLab-daemonText">
          Daemon{status.pid !== undefined ? ` pid ${status.pid}` : ''} is not answering
          (stopped or stuck): loads run without the cache. Run{' '}
          <code>overmind-lab stop --force</code>.
        </span>
      </div>
    );
  }
  if (!status.running) {
    return (
      <div
        className="jp-OvermindLab-daemon jp-OvermindLab-daemon-down"
        title={status.error ?? `no daemon on ${status.socket}`}
      >
        <span className="jp-OvermindLab-dot" aria-hidden="true" />
        <span className="jp-OvermindLab-daemonText">
          Daemon not running. The next cached load starts it.
        </span>
        <button
          type="button"
          className="jp-Button jp-mod-styled jp-mod-accept jp-OvermindLab-start"
          aria-label="Start the overmind-lab daemon"
          disabled={model.starting}
          onClick={() => void model.startDaemon()}
        >
          {model.starting ? 'Starting…' : 'Start'}
        </button>
      </div>
    );
  }
  const count = status.entries ?? 0;
  return (
    <div
      className="jp-OvermindLab-daemon jp-OvermindLab-daemon-up"
      title={`socket ${status.socket}${status.version ? `, version ${status.version}` : ''}`}
    >
      <span className="jp-OvermindLab-dot" aria-hidden="true" />
      <span className="jp-OvermindLab-daemonText">
        Daemon running · pid {status.pid} · up {formatDuration(status.uptime_seconds)} ·{' '}
        {count} {count === 1 ? 'entry' : 'entries'}
      </span>
    </div>
  );
}

function MemoryBar({ status }: { status: IStatus }): JSX.Element {
  const bar = memoryBar(status);
  const pct = (x: number): string => `${(x * 100).toFixed(2)}%`;
  const cached = status.running ? status.cached_bytes ?? 0 : 0;
  const evicted = status.evicted_mapped_bytes ?? 0;
  const total = status.memory_total_bytes;
  const otherBytes = total !== null ? bar.other * total : null;
  // The user's own files held open: apart from the bar, the cache and its budget.
  const held = heldSummary(status);
  const summary =
    `Cache ${formatBytes(cached)}` +
    (status.budget_bytes !== undefined ? ` of ${formatBytes(status.budget_bytes)} budget` : '') +
    (held !== null ? `; ${held.label} (not in the budget)` : '') +
    `; system ${formatBytes(status.memory_available_bytes)} available of ` +
    formatBytes(status.memory_total_bytes) +
    (bar.budget !== null ? '; the mark is where the budget ends' : '');
  return (
    <div className="jp-OvermindLab-memory">
      <div
        className="jp-OvermindLab-memoryBar"
        role="img"
        aria-label={summary}
        title={summary}
      >
        <div
          className={`jp-OvermindLab-memoryCache${bar.overBudget ? ' jp-mod-over' : ''}`}
          style={{ width: pct(bar.cached) }}
        />
        <div className="jp-OvermindLab-memoryOther" style={{ width: pct(bar.other) }} />
        {bar.budget !== null && (
          <div className="jp-OvermindLab-memoryBudget" style={{ left: pct(bar.budget) }} />
        )}
      </div>
      <div className="jp-OvermindLab-memoryLegend">
        <span>
          <span className="jp-OvermindLab-swatch jp-OvermindLab-swatch-cache" />
          cache <strong>{formatBytes(cached)}</strong>
          {status.budget_bytes !== undefined && <> / {formatBytes(status.budget_bytes)} budget</>}
        </span>
        {held !== null && (
          <span className="jp-OvermindLab-held" title={held.title}>
            {held.label}
          </span>
        )}
        {status.running && status.tier !== undefined && (
          <span
            className="jp-OvermindLab-tier"
            title={
              status.tier === 'file'
                ? `Segment files in ${status.cache_dir ?? '?'}: they survive restarts; the ` +
                  'kernel may reclaim their pages under memory pressure'
                : `In memory (memfd tier): ${status.tier_reason ?? ''}`
            }
          >
            {status.tier === 'file' ? (
              <>
                {formatBytes(status.disk_bytes ?? 0)} on disk,{' '}
                {formatBytes(status.resident_bytes ?? 0)} resident
              </>
            ) : (
              <>in memory (memfd tier), {formatBytes(status.resident_bytes ?? 0)} resident</>
            )}
          </span>
        )}
        {otherBytes !== null && (
          <span>
            <span className="jp-OvermindLab-swatch jp-OvermindLab-swatch-other" />
            {formatBytes(otherBytes)} other
          </span>
        )}
        <span>
          <span className="jp-OvermindLab-swatch jp-OvermindLab-swatch-free" />
          {formatBytes(status.memory_available_bytes)} free of{' '}
          {formatBytes(status.memory_total_bytes)}
        </span>
        {evicted > 0 && (
          <span title="Evicted entries that kernels still map: freed when they let go">
            {formatBytes(evicted)} evicted, still mapped
          </span>
        )}
      </div>
    </div>
  );
}

function EntryRow({ entry, model }: { entry: IEntry; model: OvermindModel }): JSX.Element {
  const pending = model.pending(entry.key);
  const refreshing = model.isRefreshing(entry);
  const name = shortName(entry);
  const source = sourceLabel(entry.source);
  const size = entrySize(entry);
  const busy = pending !== null || refreshing;
  return (
    <li
      className={`jp-OvermindLab-entry${busy ? ' jp-mod-busy' : ''}`}
      data-key={entry.key}
      aria-label={
        `${name}${source ? ` ${source}` : ''}, ${formatBytes(size.cached)}` +
        (size.held > 0 ? `, ${formatBytes(size.held)} of your own files held` : '')
      }
    >
      <div className="jp-OvermindLab-entryName" title={entry.name}>
        <BreakAtDots text={name} />
      </div>
      <div className="jp-OvermindLab-entrySub">
        <span className="jp-OvermindLab-entrySource" title={entry.source ?? ''}>
          {source}
        </span>
        <span className="jp-OvermindLab-entrySize" title={size.title}>
          {formatBytes(size.cached)}
        </span>
        {size.heldLabel !== null && (
          <span className="jp-OvermindLab-entryHeld" title={size.title}>
            {size.heldLabel}
          </span>
        )}
      </div>
      <div className="jp-OvermindLab-entryStats">
        <span title={`${entry.hits} warm loads`}>
          {entry.hits} {entry.hits === 1 ? 'hit' : 'hits'}
        </span>
        {entry.verified ? (
          <span
            className="jp-OvermindLab-verified"
            title={`${entry.verified} warm loads were compared with a plain load and found equal (verify mode)`}
          >
            {entry.verified} verified
          </span>
        ) : null}
        <span title={new Date(entry.last_used * 1000).toLocaleString()}>
          used {formatAgo(entry.last_used)}
        </span>
        <span title={entry.holders.length ? `pids ${entry.holders.join(', ')}` : undefined}>
          held by {holdersLabel(entry.holders)}
        </span>
      </div>
      <TimingBar entry={entry} />
      {refreshing && <RefreshProgress entry={entry} />}
      {!refreshing && entry.refresh.state === 'failed' && (
        <div className="jp-OvermindLab-refreshFailed" role="alert">
          Refresh failed: {entry.refresh.message || 'no reason given'}
        </div>
      )}
      <div className="jp-OvermindLab-entryActions">
        <IconButton
          icon={refreshIcon}
          label={`Refresh ${name}`}
          title={
            entry.replayable
              ? 'Reload from source in the background and replace this entry'
              : 'This call cannot be replayed: refresh evicts it'
          }
          disabled={busy}
          onClick={() => void model.refresh(entry.key)}
        />
        <IconButton
          icon={deleteIcon}
          label={`Evict ${name}`}
          title="Evict from the cache (kernels that hold it keep their copy)"
          disabled={busy}
          onClick={() => void model.evict(entry.key)}
        />
      </div>
    </li>
  );
}

function TimingBar({ entry }: { entry: IEntry }): JSX.Element {
  const bar = timingBar(entry);
  const label =
    bar.warmSeconds === null
      ? `cold load ${formatSeconds(bar.coldSeconds)}, no warm load yet`
      : `cold load ${formatSeconds(bar.coldSeconds)}, median warm load ` +
        `${formatSeconds(bar.warmSeconds)}, ${formatSpeedup(bar.speedup)} faster`;
  return (
    <div className="jp-OvermindLab-timing" role="img" aria-label={label} title={label}>
      <div className="jp-OvermindLab-timingRow">
        <span className="jp-OvermindLab-timingLabel">cold</span>
        <span className="jp-OvermindLab-timingTrack">
          <span
            className="jp-OvermindLab-timingCold"
            style={{ width: `${bar.cold * 100}%` }}
          />
        </span>
        <span className="jp-OvermindLab-timingValue">{formatSeconds(bar.coldSeconds)}</span>
      </div>
      <div className="jp-OvermindLab-timingRow">
        <span className="jp-OvermindLab-timingLabel">warm</span>
        <span className="jp-OvermindLab-timingTrack">
          <span
            className="jp-OvermindLab-timingWarm"
            style={{ width: `${bar.warm * 100}%` }}
          />
        </span>
        <span className="jp-OvermindLab-timingValue">
          {bar.warmSeconds === null ? 'not yet' : formatSeconds(bar.warmSeconds)}
        </span>
      </div>
      {bar.speedup !== null && (
        <div className="jp-OvermindLab-speedup">{formatSpeedup(bar.speedup)} faster</div>
      )}
    </div>
  );
}

function RefreshProgress({ entry }: { entry: IEntry }): JSX.Element {
  const started = entry.refresh.started;
  const elapsed = started !== null ? Date.now() / 1000 - started : null;
  return (
    <div className="jp-OvermindLab-refreshing">
      <div
        className="jp-OvermindLab-progress"
        role="progressbar"
        aria-label={`Refreshing ${shortName(entry)}`}
        aria-busy="true"
      />
      <span className="jp-OvermindLab-refreshText">
        Refreshing{elapsed !== null && elapsed >= 1 ? ` · ${formatDuration(elapsed)}` : '…'}
        {entry.refresh.message ? ` · ${entry.refresh.message}` : ''}
      </span>
    </div>
  );
}

function EmptyState({ running }: { running: boolean }): JSX.Element {
  return (
    <div className="jp-OvermindLab-empty">
      <overmindIcon.react tag="div" className="jp-OvermindLab-emptyIcon" />
      <p>
        {running ? 'Nothing is cached yet.' : 'Nothing is cached.'} Load a model through the
        cache in a notebook:
      </p>
      <pre className="jp-OvermindLab-code">
        {'%load_ext overmind_lab\n%overmind_load unet = UNet2DConditionModel.from_pretrained(path)'}
      </pre>
      <p>
        The first load runs as usual and is kept in shared memory; later loads in any kernel
        take milliseconds.
      </p>
    </div>
  );
}

/** `a.b.c` that wraps after its dots rather than inside a word. */
function BreakAtDots({ text }: { text: string }): JSX.Element {
  const parts = text.split('.');
  return (
    <>
      {parts.map((part, i) => (
        <React.Fragment key={i}>
          {part}
          {i < parts.length - 1 && (
            <>
              .<wbr />
            </>
          )}
        </React.Fragment>
      ))}
    </>
  );
}

function IconButton(props: {
  icon: LabIcon;
  label: string;
  title?: string;
  disabled?: boolean;
  onClick: () => void;
}): JSX.Element {
  return (
    <button
      type="button"
      className="jp-Button jp-mod-minimal jp-OvermindLab-iconButton"
      aria-label={props.label}
      title={props.title ?? props.label}
      disabled={props.disabled}
      onClick={props.onClick}
    >
      <props.icon.react tag="span" elementSize="normal" />
    </button>
  );
}
