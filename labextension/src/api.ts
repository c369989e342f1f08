/**
 * The REST client of the overmind-lab server extension.
 */

import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import { IEntry, IOvermindAPI, IStatus, IZygote } from './types';

/** Path of the API below the server's base URL. */
export const API_PATH = 'overmind-lab/api/v1';

/**
 * Call the server extension. URLs are built from `settings.baseUrl`, so the sidebar works
 * under a non-root `base_url`; authentication (token, XSRF) is ServerConnection's.
 *
 * Rejects with `ServerConnection.NetworkError` when the server cannot be reached and
 * `ServerConnection.ResponseError` (carrying the server's JSON `message`) otherwise.
 */
export async function requestAPI<T>(
  settings: ServerConnection.ISettings,
  endPoint: string,
  init: RequestInit = {}
): Promise<T> {
  const url = URLExt.join(settings.baseUrl, API_PATH, endPoint);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new ServerConnection.NetworkError(error as TypeError);
  }
  const text = await response.text();
  let data: unknown = null;
  if (text.length > 0) {
    try {
      data = JSON.parse(text);
    } catch {
      throw new ServerConnection.ResponseError(
        response,
        `unexpected answer from ${url} (is the overmind-lab server extension enabled?)`
      );
    }
  }
  if (!response.ok) {
    const message =
      data && typeof data === 'object' && 'message' in data
        ? String((data as { message: unknown }).message)
        : `${response.status} ${response.statusText}`;
    throw new ServerConnection.ResponseError(response, message);
  }
  return data as T;
}

/** {@link IOvermindAPI} over REST. */
export class RestAPI implements IOvermindAPI {
  constructor(settings: ServerConnection.ISettings) {
    this._settings = settings;
  }

  status(): Promise<IStatus> {
    return requestAPI<IStatus>(this._settings, 'status');
  }

  async entries(): Promise<IEntry[]> {
    const reply = await requestAPI<{ entries: IEntry[] }>(this._settings, 'entries');
    return reply.entries;
  }

  async evict(key: string): Promise<string[]> {
    const reply = await requestAPI<{ evicted: string[] }>(
      this._settings,
      `entries/${encodeURIComponent(key)}/evict`,
      { method: 'POST' }
    );
    return reply.evicted;
  }

  async evictAll(): Promise<string[]> {
    const reply = await requestAPI<{ evicted: string[] }>(this._settings, 'evict-all', {
      method: 'POST'
    });
    return reply.evicted;
  }

  async refresh(key: string): Promise<IEntry> {
    const reply = await requestAPI<{ entry: IEntry }>(
      this._settings,
      `entries/${encodeURIComponent(key)}/refresh`,
      { method: 'POST' }
    );
    return reply.entry;
  }

  startDaemon(): Promise<IStatus> {
    return requestAPI<IStatus>(this._settings, 'daemon/start', { method: 'POST' });
  }

  async zygotes(): Promise<IZygote[]> {
    const reply = await requestAPI<{ zygotes: IZygote[] }>(this._settings, 'zygotes');
    return reply.zygotes;
  }

  async restartZygotes(): Promise<number[]> {
    const reply = await requestAPI<{ restarted: number[] }>(this._settings, 'zygotes/restart', {
      method: 'POST'
    });
    return reply.restarted;
  }

  private _settings: ServerConnection.ISettings;
}
