/**
 * Browser tests of the overmind-lab sidebar.
 *
 * Run them through `pytest tests/test_ui.py`, which starts the daemon and a real
 * `jupyter lab` under a non-root base URL and passes them here in the environment:
 *
 *   OVERMIND_UI_URL        e.g. http://127.0.0.1:8899/lab-test/
 *   OVERMIND_UI_TOKEN      the server's token
 *   OVERMIND_UI_ARTIFACTS  where screenshots go (default: ./artifacts)
 *   OVERMIND_UI_CHROMIUM   the browser (default: Debian's /usr/bin/chromium)
 */
import { defineConfig } from '@playwright/test';

export default defineConfig({
  testDir: './tests',
  timeout: 10 * 60 * 1000,
  // generous: a loaded machine (CI, 2 shared cores) must not fail an expectation
  expect: { timeout: 120 * 1000 },
  retries: 0,
  workers: 1,
  reporter: [['list']],
  outputDir: 'test-results',
  use: {
    baseURL: process.env.OVERMIND_UI_URL,
    viewport: { width: 1400, height: 900 },
    video: 'off',
    trace: 'off',
    screenshot: 'only-on-failure',
    launchOptions: {
      executablePath: process.env.OVERMIND_UI_CHROMIUM || '/usr/bin/chromium',
      args: [
        '--no-sandbox',
        '--disable-gpu',
        '--disable-background-networking',
        '--disable-component-update'
      ]
    }
  }
});
