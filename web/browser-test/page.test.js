// Headless Chromium (Debian's chromium, driven by puppeteer-core; no browser download): the example page
// replays the conformance fixtures, trains the classifier, draws the chart and saves a checkpoint.
// The screenshot goes to docs/web-training.png only when asked (`npm run screenshot`, which sets
// ONNXTRAIN_SCREENSHOT=1); otherwise to a temporary folder that the test removes.
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, test } from 'node:test';
import { fileURLToPath } from 'node:url';
import { launch, openAndWait } from './chromium.js';
import { serve } from '../example/serve.mjs';

const DOCS_SCREENSHOT = fileURLToPath(new URL('../../docs/web-training.png', import.meta.url));
const RTOL = 1e-5;
let server;
let browser;

before(async () => {
  server = await serve(0);
  browser = await launch();
});

after(async () => {
  await browser?.close();
  server?.close();
});

test('the page trains in Chromium: fixtures match the Python runtime, the chart drew, the checkpoint saves', async () => {
  const page = await browser.newPage();
  await page.setViewport({ width: 820, height: 640 });
  const { port } = server.address();
  const result = await openAndWait(page, `http://127.0.0.1:${port}/web/example/?conformance=1&steps=150`);
  assert.equal(result.error, null);
  assert.equal(result.crossOriginIsolated, true, 'COOP/COEP headers did not make the page cross-origin isolated');
  for (const [name, c] of Object.entries(result.conformance)) {
    console.log(`# chromium ${name}: loss error ${c.lossError.toExponential(1)}, worst ${c.worst} ${c.paramError.toExponential(1)}`);
    assert.ok(c.lossError <= RTOL, `${name}: losses differ by ${c.lossError}`);
    assert.ok(c.paramError <= RTOL, `${name}: ${c.worst} differs by ${c.paramError}`);
  }
  assert.equal(result.chartPoints, 150);
  const first = result.losses.slice(0, 10).reduce((a, b) => a + b) / 10;
  const last = result.losses.slice(-10).reduce((a, b) => a + b) / 10;
  assert.ok(last < 0.6 * first, `the loss did not fall: ${first} -> ${last}`);
  assert.ok(result.accuracy > 0.8, `test accuracy ${result.accuracy}`);
  assert.equal(result.reloaded, 150);
  // The chart drew: count the loss line's blue pixels on the canvas.
  const blue = await page.evaluate(() => {
    const canvas = document.getElementById('loss');
    const pixels = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
    let n = 0;
    for (let i = 0; i < pixels.length; i += 4) n += pixels[i + 2] > 150 && pixels[i] < 80 && pixels[i + 3] > 0;
    return n;
  });
  assert.ok(blue > 300, `the loss chart has ${blue} line pixels`);
  if (process.env.ONNXTRAIN_SCREENSHOT === '1') {
    await page.screenshot({ path: DOCS_SCREENSHOT });
  } else {
    const dir = mkdtempSync(join(tmpdir(), 'onnxtrain-web-'));
    try {
      await page.screenshot({ path: join(dir, 'web-training.png') });
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  }
});
