// Debian's Chromium driven by puppeteer-core (no browser download), for the page test and the benchmark.
import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import puppeteer from 'puppeteer-core';

export const CHROMIUM = process.env.CHROMIUM ?? ['/usr/bin/chromium', '/usr/bin/chromium-browser'].find(existsSync);

/** Headless Chromium; `args`: extra command-line switches (bench/providers.mjs enables WebNN). */
export async function launch(args = []) {
  assert.ok(CHROMIUM, 'no Chromium found: install Debian\'s chromium (apt-get install chromium) or set CHROMIUM');
  return puppeteer.launch({
    executablePath: CHROMIUM, headless: true,
    args: ['--no-sandbox', '--disable-dev-shm-usage', '--enable-unsafe-webgpu', '--enable-unsafe-swiftshader', ...args],
  });
}

/** Open the example page at `url` and wait for it to finish; returns its window.onnxtrainResult. */
export async function openAndWait(page, url, timeout = 240_000) {
  await page.goto(url);
  await page.waitForFunction(() => window.onnxtrainResult?.done, { timeout, polling: 200 });
  return page.evaluate(() => window.onnxtrainResult);
}
