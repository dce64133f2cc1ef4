// The benchmark's step time in Node, on the same onnxruntime-web WebAssembly as the browser (one process
// per thread count: onnxruntime-web fixes its thread count when it first loads). Prints JSON.
//   node bench/node_step.mjs <bench folder> <threads> [no-train-step]   (the last: two calls a step)
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import * as ort from 'onnxruntime-web';
import { stepTime } from './step_time.js';

const [folder, threads = '1', variant] = process.argv.slice(2);
ort.env.wasm.numThreads = Number(threads);
const options = { trainStep: variant !== 'no-train-step' };
const result = await stepTime(async (file) => new Uint8Array(readFileSync(join(folder, file))), options);
console.log(JSON.stringify({ ...result, threads: Number(threads) }));
