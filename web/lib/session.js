// onnxruntime-web sessions: creation in one function, the models' metadata, and the checks of a step's
// inputs before onnxruntime sees them (docs/format.md, "Input checks").
import * as ort from 'onnxruntime-web';
import { OnnxtrainError } from './format.js';
import { modelMetadata } from './protobuf.js';

/** A model's bytes: given as bytes, or fetched from a URL. */
export async function modelBytes(source, what) {
  if (source instanceof Uint8Array) return source;
  if (source instanceof ArrayBuffer) return new Uint8Array(source);
  if (typeof source === 'string' || source instanceof URL) {
    const response = await fetch(source);
    if (!response.ok) throw new OnnxtrainError(`cannot fetch the ${what} ${source}: HTTP ${response.status}`);
    return new Uint8Array(await response.arrayBuffer());
  }
  throw new OnnxtrainError(`the ${what} must be a URL, a Uint8Array or an ArrayBuffer`);
}

/** The JSON description under `key` in the model's metadata; a clear error when it is absent. */
export function readMetadata(bytes, key, what) {
  let raw;
  try {
    raw = modelMetadata(bytes).get(key);
  } catch (error) {
    throw new OnnxtrainError(`this file is not an onnxtrain ${what}: ${error.message}`);
  }
  if (raw === undefined) {
    throw new OnnxtrainError(`this file is not an onnxtrain ${what} (metadata ${JSON.stringify(key)} missing); ` +
      'generate it with onnxtrain.artifacts.generate_artifacts');
  }
  return JSON.parse(raw);
}

/** The one place the runtime creates an onnxruntime-web session. */
export async function createSession(bytes, options = {}, what = 'model') {
  try {
    return await ort.InferenceSession.create(bytes, {
      executionProviders: options.executionProviders ?? ['wasm'],
      graphOptimizationLevel: 'all',
      ...options.sessionOptions,
    });
  } catch (error) {
    throw new OnnxtrainError(`onnxruntime-web cannot load the ${what}: ${error.message ?? error}`);
  }
}

const show = (shape) => `[${shape.map((d) => (typeof d === 'number' && d >= 0 ? d : d || '?')).join(', ')}]`;

/** Checks a step's user inputs: count, element type, rank, fixed and named sizes, value ranges. */
export class InputChecker {
  constructor(session, names, ranges = {}) {
    this.names = names;
    const declared = new Map((session.inputMetadata ?? []).map((m) => [m.name, m]));
    this.declared = new Map(names.map((n) => [n, declared.get(n)]));
    this.ranges = ranges;
  }

  /** `feeds`: an object by input name, or an array in input order. Returns the object. */
  check(feeds) {
    if (Array.isArray(feeds)) {
      if (feeds.length !== this.names.length) {
        throw new OnnxtrainError(`the model takes ${this.names.length} inputs [${this.names}] (model inputs, then loss ` +
          `inputs), got ${feeds.length}`);
      }
      feeds = Object.fromEntries(this.names.map((n, i) => [n, feeds[i]]));
    }
    const missing = this.names.filter((n) => !(n in feeds));
    if (missing.length) throw new OnnxtrainError(`missing input ${missing.map((n) => JSON.stringify(n)).join(', ')}; the model takes [${this.names}]`);
    const extra = Object.keys(feeds).filter((n) => !this.names.includes(n));
    if (extra.length) throw new OnnxtrainError(`unknown input ${extra.map((n) => JSON.stringify(n)).join(', ')}; the model takes [${this.names}]`);
    const seen = new Map();
    for (const name of this.names) {
      const tensor = feeds[name];
      if (!(tensor instanceof ort.Tensor)) throw new OnnxtrainError(`input ${JSON.stringify(name)} must be an ort.Tensor`);
      const meta = this.declared.get(name);
      if (meta && meta.isTensor !== false) this.checkShape(name, tensor, meta, seen);
      const range = this.ranges[name];
      if (range) checkRange(name, tensor, range);
    }
    return feeds;
  }

  checkShape(name, tensor, meta, seen) {
    if (meta.type && tensor.type !== meta.type) {
      throw new OnnxtrainError(`input ${JSON.stringify(name)} must be ${meta.type}, got ${tensor.type}`);
    }
    const want = meta.shape;
    const have = tensor.dims;
    if (!want) return;
    if (want.length !== have.length) {
      throw new OnnxtrainError(`input ${JSON.stringify(name)} must have ${want.length} dimensions ${show(want)}, got shape [${have}]`);
    }
    want.forEach((w, axis) => {
      const h = have[axis];
      if (typeof w === 'number' && w >= 0 && w !== h) {
        throw new OnnxtrainError(`input ${JSON.stringify(name)} must have size ${w} on axis ${axis} (shape ${show(want)}), got shape [${have}]`);
      }
      if (typeof w === 'string' && w) {
        if (!seen.has(w)) seen.set(w, [name, axis, h]);
        const [first, firstAxis, size] = seen.get(w);
        if (size !== h) {
          throw new OnnxtrainError(`input ${JSON.stringify(name)} has ${h} on axis ${axis} but input ${JSON.stringify(first)} has ` +
            `${size} on axis ${firstAxis}; the model needs them equal (${JSON.stringify(w)})`);
        }
      }
    });
  }
}

function checkRange(name, tensor, { low, high, ignore, what }) {
  const data = tensor.data;
  const big = typeof data[0] === 'bigint';
  const lo = big ? BigInt(low) : low;
  const hi = big ? BigInt(high) : high;
  const skip = ignore === undefined || ignore === null ? null : big ? BigInt(ignore) : ignore;
  for (let i = 0; i < data.length; i++) {
    const v = data[i];
    if ((v < lo || v >= hi) && v !== skip) {
      const index = [];
      let rest = i;
      for (let axis = tensor.dims.length - 1; axis >= 0; axis--) {
        index.unshift(rest % tensor.dims[axis]);
        rest = Math.floor(rest / tensor.dims[axis]);
      }
      const also = skip === null ? '' : ` (or ${ignore}, ignored)`;
      throw new OnnxtrainError(`input ${JSON.stringify(name)} has value ${v} at [${index.join(', ')}], out of range: ` +
        `${what} must lie in [${low}, ${high})${also}`);
    }
  }
}
