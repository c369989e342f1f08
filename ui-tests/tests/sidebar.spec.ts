/**
 * The sidebar against a real JupyterLab, real kernels and a real daemon.
 *
 * tests/test_ui.py prepares the server's root directory:
 *   models/unet/    a tiny diffusers UNet2DConditionModel
 *   load.ipynb      %load_ext overmind_lab; %overmind_load unet = ...from_pretrained("models/unet")
 *   again.ipynb     the same cells (a second kernel: a warm load)
 *   change.ipynb    saves new weights into models/unet (the model on disk changes)
 *   stop.ipynb      stops the daemon (Client().stop())
 *   warm.ipynb, warm-again.ipynb
 *                   print("WARM", pid) in the warm kernel ("Python 3 (warm, overmind-lab)",
 *                   installed where the server finds it): the first launch is plain and
 *                   starts the zygote, later ones are forked from it
 */
import * as fs from 'fs';
import * as path from 'path';

import { APIRequestContext, expect, Locator, Page, Request, test } from '@playwright/test';

const BASE = process.env.OVERMIND_UI_URL ?? '';
const TOKEN = process.env.OVERMIND_UI_TOKEN ?? '';
const ARTIFACTS = process.env.OVERMIND_UI_ARTIFACTS || path.join(__dirname, '..', 'artifacts');
const API = `${BASE}overmind-lab/api/v1/`;
const SIDEBAR_ID = 'jp-OvermindLab-sidebar';
const UNET_NAME = /^UNet2DConditionModel\.from_pretrained/;

interface IEntry {
  key: string;
  bytes: number;
  hits: number;
  warm_seconds: number[];
  refresh: { state: string; message: string };
}

const auth = { Authorization: `token ${TOKEN}` };

async function restEntries(request: APIRequestContext): Promise<IEntry[]> {
  const response = await request.get(`${API}entries`, { headers: auth });
  expect(response.ok()).toBeTruthy();
  return (await response.json()).entries as IEntry[];
}

interface IZygote {
  pid: number;
  preloaded: number;
  preload_roots: string[];
  forks: number;
  retiring: string | null;
}

async function restZygotes(request: APIRequestContext): Promise<IZygote[]> {
  const response = await request.get(`${API}zygotes`, { headers: auth });
  expect(response.ok()).toBeTruthy();
  return (await response.json()).zygotes as IZygote[];
}

async function restStatus(request: APIRequestContext): Promise<Record<string, unknown>> {
  const response = await request.get(`${API}status`, { headers: auth });
  expect(response.ok()).toBeTruthy();
  return response.json();
}

async function openLab(page: Page): Promise<void> {
  await page.goto(`${BASE}lab?token=${TOKEN}`);
  await page.waitForFunction(() => (window as any).jupyterapp !== undefined);
  await page.evaluate(() => (window as any).jupyterapp.restored);
  await expect(page.locator('#jp-main-dock-panel')).toBeVisible();
}

async function execute(page: Page, command: string, args: object = {}): Promise<void> {
  // Resolve to nothing: a command's result (a widget) cannot cross into the test.
  await page.evaluate(
    async ({ command, args }) => {
      await (window as any).jupyterapp.commands.execute(command, args);
    },
    { command, args }
  );
}

/** Open a notebook, run all its cells in its kernel, wait for `expected` in an output. */
async function runNotebook(page: Page, name: string, expected: string): Promise<void> {
  await execute(page, 'docmanager:open', { path: name });
  await page.waitForFunction(
    name => (window as any).jupyterapp.shell.currentWidget?.context?.path === name,
    name
  );
  // Wait for the notebook's kernel: running cells before it exists asks for a kernel.
  const id = await page.evaluate(async () => {
    const panel = (window as any).jupyterapp.shell.currentWidget;
    await panel.context.ready;
    await panel.sessionContext.ready;
    return panel.id as string;
  });
  await page.waitForFunction(
    id => {
      const panel = (window as any).jupyterapp.shell.currentWidget;
      return panel?.id === id && panel.sessionContext.session?.kernel?.status === 'idle';
    },
    id,
    { timeout: 120_000 }
  );
  const notebook = page.locator(`[id="${id}"]`);
  await expect(notebook.locator('.jp-Notebook-cell')).not.toHaveCount(0);
  await execute(page, 'notebook:run-all-cells');
  await expect(notebook.locator('.jp-OutputArea-output', { hasText: expected })).toBeVisible({
    timeout: 180_000
  });
  await expect(notebook.locator('.jp-OutputArea-output', { hasText: 'Traceback' })).toHaveCount(0);
}

function sidebarTab(page: Page): Locator {
  return page.locator(`.jp-SideBar li[data-id="${SIDEBAR_ID}"]`);
}

async function showSidebar(page: Page): Promise<Locator> {
  await execute(page, 'overmind-lab:open');
  const panel = page.locator(`#${SIDEBAR_ID}`);
  await expect(panel).toBeVisible();
  return panel;
}

async function setTheme(page: Page, theme: 'JupyterLab Light' | 'JupyterLab Dark'): Promise<void> {
  await execute(page, 'apputils:change-theme', { theme });
  await expect(page.locator('body')).toHaveAttribute('data-jp-theme-name', theme);
  await page.waitForTimeout(500); // the theme's CSS variables settle
}

async function screenshots(page: Page, panel: Locator, name: string): Promise<void> {
  fs.mkdirSync(ARTIFACTS, { recursive: true });
  await panel.screenshot({ path: path.join(ARTIFACTS, `sidebar-${name}.png`) });
  await page.screenshot({ path: path.join(ARTIFACTS, `lab-${name}.png`) });
}

test.beforeAll(async ({ request }) => {
  expect(BASE, 'run through tests/test_ui.py, which starts JupyterLab').toMatch(/\/lab-test\/$/);
  // Poll every second so the test does not wait on the default 5 s interval.
  const response = await request.put(`${BASE}lab/api/settings/overmind-lab:plugin`, {
    headers: auth,
    data: { raw: JSON.stringify({ refreshInterval: 1 }) }
  });
  expect(response.status()).toBe(204);
});

test('the sidebar shows, refreshes and evicts a model cached by a kernel', async ({
  page,
  request
}) => {
  const apiCalls: string[] = [];
  const inFlight = new Set<Request>();
  page.on('request', r => {
    if (r.url().includes('/overmind-lab/api/v1/')) {
      apiCalls.push(r.url());
      inFlight.add(r);
    }
  });
  page.on('requestfinished', r => inFlight.delete(r));
  page.on('requestfailed', r => inFlight.delete(r));

  await openLab(page);
  await expect(sidebarTab(page)).toBeVisible();
  let panel = await showSidebar(page);

  await test.step('empty state tells a new user what to type', async () => {
    await expect(panel.locator('.jp-OvermindLab-daemon-up')).toContainText('Daemon running');
    await expect(panel.locator('.jp-OvermindLab-empty')).toContainText('%load_ext overmind_lab');
    await expect(panel.locator('.jp-OvermindLab-empty')).toContainText('%overmind_load');
    await expect(panel.locator('.jp-OvermindLab-memoryBar')).toBeVisible();
    await expect(panel.locator('.jp-OvermindLab-warmEmpty')).toContainText('overmind-lab kernel install');
    await expect(panel.locator('.jp-OvermindLab-warmEmpty')).toContainText('Python 3 (warm, overmind-lab)');
    await screenshots(page, panel, 'empty-light');
  });

  await test.step('requests go under the base URL, and a hidden sidebar makes none', async () => {
    expect(apiCalls.length).toBeGreaterThan(0);
    for (const url of apiCalls) {
      expect(url.startsWith(API)).toBeTruthy();
    }
    await page.locator('.jp-SideBar li[data-id="filebrowser"]').click();
    await expect(panel).toBeHidden();
    // a refresh already in flight (its requests start together) may still land: wait
    // until it has, not a fixed time that a loaded machine can outlast
    await expect.poll(() => inFlight.size, { timeout: 120_000 }).toBe(0);
    const before = apiCalls.length;
    await page.waitForTimeout(4000); // four poll intervals: none may start while hidden
    expect(apiCalls.length).toBe(before);
    panel = await showSidebar(page);
    await expect.poll(() => apiCalls.length, { timeout: 120_000 }).toBeGreaterThan(before);
  });

  const row = panel.locator('.jp-OvermindLab-entry');

  await test.step('a kernel loads a model: the sidebar shows its size and cold time', async () => {
    await runNotebook(page, 'load.ipynb', 'LOADED UNet2DConditionModel');
    panel = await showSidebar(page);
    await expect(row).toHaveCount(1);
    await expect(row.locator('.jp-OvermindLab-entryName')).toHaveText(UNET_NAME);
    await expect(row.locator('.jp-OvermindLab-entrySource')).toHaveText('unet');
    const [entry] = await restEntries(request);
    expect(entry.bytes).toBeGreaterThan(0);
    await expect(row).toHaveAttribute('data-key', entry.key);
    await expect(row.locator('.jp-OvermindLab-entrySize')).toHaveText(/^\d+(\.\d+)? (KiB|MiB)$/);
    await expect(row.locator('.jp-OvermindLab-timingValue').first()).toHaveText(/\d+(\.\d+)? (ms|s)$/);
    await expect(row).toContainText('0 hits');
  });

  await test.step('a second kernel loads it warm: hits, warm time and speed-up', async () => {
    await runNotebook(page, 'again.ipynb', 'LOADED UNet2DConditionModel');
    await expect(row).toContainText('1 hit', { timeout: 120_000 });
    await expect(row.locator('.jp-OvermindLab-speedup')).toHaveText(/^\d+(\.\d+)?× faster$/);
    await expect(row.locator('.jp-OvermindLab-timingValue').nth(1)).toHaveText(/\d+(\.\d+)? (ms|s)$/);
    await expect(row.locator('.jp-OvermindLab-entryStats')).toContainText(/held by \d+ process/);
    const [entry] = await restEntries(request);
    expect(entry.hits).toBe(1);
    expect(entry.warm_seconds.length).toBe(1);
  });

  await test.step('warm kernels: the first starts the zygote, the next is forked', async () => {
    await runNotebook(page, 'warm.ipynb', 'WARM');
    // The zygote imports torch, diffusers, transformers... before it is listed.
    await expect
      .poll(async () => (await restZygotes(request)).filter(z => !z.retiring).length, {
        timeout: 300_000
      })
      .toBe(1);
    await runNotebook(page, 'warm-again.ipynb', 'WARM');
    const [zygote] = await restZygotes(request);
    expect(zygote.forks).toBe(1);
    panel = await showSidebar(page);
  });

  await test.step('the warm kernels section shows the zygote', async () => {
    const [zygote] = await restZygotes(request);
    expect(zygote.preloaded).toBeGreaterThan(0);
    const zrow = panel.locator(`.jp-OvermindLab-zygote[data-pid="${zygote.pid}"]`);
    await expect(zrow).toBeVisible();
    await expect(zrow.locator('.jp-OvermindLab-zygoteName')).toHaveText(`Zygote · pid ${zygote.pid}`);
    await expect(zrow.locator('.jp-OvermindLab-zygoteState')).toHaveText('ready');
    await expect(zrow.locator('.jp-OvermindLab-zygoteMemory')).toHaveText(
      /^RSS \d+(\.\d+)? (MiB|GiB) · PSS \d+(\.\d+)? (MiB|GiB)$/
    );
    await expect(zrow.locator('.jp-OvermindLab-zygoteForks')).toHaveText('1 fork');
    await expect(zrow.locator('.jp-OvermindLab-zygoteLastFork')).toHaveText(/^last fork [\d.]+ ms$/);
    await expect(zrow).toContainText('1 kernel running');
    const modules = zrow.locator('.jp-OvermindLab-modules');
    await expect(modules.locator('summary')).toHaveText(`${zygote.preloaded} modules preloaded`);
    await expect(modules.locator('.jp-OvermindLab-moduleList')).toBeHidden();
    await modules.locator('summary').click();
    await expect(modules.locator('.jp-OvermindLab-moduleList')).toContainText('torch');
    await modules.locator('summary').click();
    await expect(modules.locator('.jp-OvermindLab-moduleList')).toBeHidden();
  });

  await test.step('screenshots in the light and dark themes', async () => {
    await screenshots(page, panel, 'light');
    // The README's picture (`make images`): the panel's content, without the empty rest.
    await panel
      .locator('.jp-OvermindLab-panel')
      .screenshot({ path: path.join(ARTIFACTS, 'readme-sidebar.png') });
    await setTheme(page, 'JupyterLab Dark');
    await screenshots(page, panel, 'dark');
    await setTheme(page, 'JupyterLab Light');
  });

  await test.step('restart the zygote: a new one, with a new pid, replaces it', async () => {
    const [old] = await restZygotes(request);
    const restart = panel.getByRole('button', { name: 'Restart the warm-kernel zygote' });
    await restart.click();
    await expect(restart).toBeDisabled();
    // The replacement imports everything again before it is listed.
    const fresh = panel.locator(`.jp-OvermindLab-zygote:not([data-pid="${old.pid}"])`);
    await expect(fresh).toHaveCount(1, { timeout: 300_000 });
    await expect(panel.locator(`.jp-OvermindLab-zygote[data-pid="${old.pid}"]`)).toHaveCount(0);
    await expect(fresh.locator('.jp-OvermindLab-zygoteState')).toHaveText('ready');
    await expect(restart).toBeEnabled();
    const zygotes = await restZygotes(request);
    expect(zygotes.map(z => z.pid)).not.toContain(old.pid);
    const pid = await fresh.getAttribute('data-pid');
    expect(zygotes.map(z => String(z.pid))).toEqual([pid]);
    await expect(panel.locator('.jp-OvermindLab-notice')).toContainText(`Zygote restarted: now pid ${pid}.`);
    await panel.getByRole('button', { name: 'Dismiss message' }).click();
  });

  let newKey = '';
  await test.step('refresh after the model on disk changed gives a new entry', async () => {
    const [old] = await restEntries(request);
    await runNotebook(page, 'change.ipynb', 'CHANGED');
    panel = await showSidebar(page);
    await panel.getByRole('button', { name: /^Refresh UNet2DConditionModel/ }).click();
    await expect(panel.getByRole('progressbar')).toBeVisible();
    // The new version is stored while the old entry still shows progress; then the old
    // entry goes.
    await expect(panel.locator(`.jp-OvermindLab-entry[data-key="${old.key}"]`)).toHaveCount(0, {
      timeout: 180_000
    });
    await expect(row).toHaveCount(1);
    await expect(panel.getByRole('progressbar')).toHaveCount(0);
    await expect(panel.locator('.jp-OvermindLab-notice')).toContainText('Refreshed');
    const entries = await restEntries(request);
    expect(entries.length).toBe(1);
    newKey = entries[0].key;
    expect(newKey).not.toBe(old.key);
    expect(entries[0].refresh.state).toBe('done');
    await expect(row).toHaveAttribute('data-key', newKey);
    await screenshots(page, panel, 'refreshed-light');
  });

  await test.step('evict from the keyboard: the daemon no longer holds it', async () => {
    const evict = panel.getByRole('button', { name: /^Evict UNet2DConditionModel/ });
    await evict.focus();
    await page.keyboard.press('Enter');
    await expect(row).toHaveCount(0);
    await expect(panel.locator('.jp-OvermindLab-empty')).toBeVisible();
    expect(await restEntries(request)).toEqual([]);
    const status = await restStatus(request);
    expect(status.entries).toBe(0);
    expect(status.cached_bytes).toBe(0);
  });

  await test.step('evict all asks first', async () => {
    await runNotebook(page, 'again.ipynb', 'LOADED UNet2DConditionModel');
    panel = await showSidebar(page);
    await expect(row).toHaveCount(1);
    const evictAll = panel.getByRole('button', { name: 'Evict all cached models' });

    await evictAll.click();
    const dialog = page.locator('.jp-Dialog');
    await expect(dialog).toContainText('Evict all cached models?');
    await dialog.getByRole('button', { name: 'Cancel' }).click();
    await expect(dialog).toHaveCount(0);
    await expect(row).toHaveCount(1);
    expect((await restEntries(request)).length).toBe(1);

    await evictAll.click();
    await page.locator('.jp-Dialog').getByRole('button', { name: 'Evict all' }).click();
    await expect(row).toHaveCount(0);
    await expect(panel.locator('.jp-OvermindLab-notice')).toContainText('Evicted 1 entry');
    expect(await restEntries(request)).toEqual([]);
    await screenshots(page, panel, 'evicted-light');
  });

  await test.step('a stopped daemon is a state with a start button', async () => {
    const pid = (await restStatus(request)).pid;
    await runNotebook(page, 'stop.ipynb', 'STOPPED True');
    panel = await showSidebar(page);
    await expect(panel.locator('.jp-OvermindLab-daemon-down')).toContainText('not running');
    expect((await restStatus(request)).running).toBe(false);
    await screenshots(page, panel, 'down-light');
    await panel.getByRole('button', { name: 'Start the overmind-lab daemon' }).click();
    await expect(panel.locator('.jp-OvermindLab-daemon-up')).toContainText('Daemon running');
    const status = await restStatus(request);
    expect(status.running).toBe(true);
    expect(status.pid).not.toBe(pid);
  });
});
