// The onnxtrain checkpoint file (docs/format.md, "Checkpoint"): a prefix, a JSON header and 64-byte aligned
// tensors, each with a CRC-32. CheckpointState holds it in memory; a Module moves the trainable parameters
// into flat buffers and the state reads them from there.
import { OnnxtrainError } from './format.js';

const MAGIC = [0x4f, 0x54, 0x43, 0x4b, 0x50, 0x54, 0x0d, 0x0a]; // "OTCKPT\r\n"
const FORMAT_VERSION = 1;
const ALIGN = 64;
const PREFIX = 24;

export const ARRAY_TYPES = {
  float32: Float32Array, float64: Float64Array, float16: Uint16Array, int8: Int8Array, int16: Int16Array,
  int32: Int32Array, int64: BigInt64Array, uint8: Uint8Array, uint16: Uint16Array, uint32: Uint32Array,
  uint64: BigUint64Array, bool: Uint8Array,
};

const CRC_TABLE = (() => {
  const table = new Uint32Array(256);
  for (let n = 0; n < 256; n++) {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    table[n] = c >>> 0;
  }
  return table;
})();

/** CRC-32 (zlib's) of a byte array. */
export function crc32(bytes) {
  let c = 0xffffffff;
  for (let i = 0; i < bytes.length; i++) c = CRC_TABLE[(c ^ bytes[i]) & 0xff] ^ (c >>> 8);
  return (c ^ 0xffffffff) >>> 0;
}

const alignUp = (n) => Math.ceil(n / ALIGN) * ALIGN;
const size = (shape) => shape.reduce((a, b) => a * b, 1);
const bytesOf = (array) => new Uint8Array(array.buffer, array.byteOffset, array.byteLength);

function readTensor(bytes, start, entry, what, nominal) {
  const Type = ARRAY_TYPES[entry.dtype];
  if (!Type) throw new OnnxtrainError(`checkpoint: ${what} has unknown element type ${JSON.stringify(entry.dtype)}`);
  const count = size(entry.shape);
  if (nominal) return new Type(count);
  if (entry.nbytes !== count * Type.BYTES_PER_ELEMENT) {
    throw new OnnxtrainError(`checkpoint: ${what} has ${entry.nbytes} bytes of data for shape [${entry.shape}] ` +
      `${entry.dtype}; the file is damaged`);
  }
  const lo = start + entry.offset;
  if (lo + entry.nbytes > bytes.length) throw new OnnxtrainError(`checkpoint is truncated inside ${what}`);
  const raw = bytes.slice(lo, lo + entry.nbytes); // a copy: aligned, and independent of the file's bytes
  if (entry.nbytes && crc32(raw) !== entry.crc32) {
    throw new OnnxtrainError(`checkpoint is damaged: the checksum of ${what} does not match`);
  }
  return new Type(raw.buffer, 0, count);
}

function readProperty(name, entry) {
  if (entry.type === 'int') return Number(entry.value);
  if (entry.type === 'float') {
    const v = String(entry.value);
    return v === 'inf' ? Infinity : v === '-inf' ? -Infinity : v === 'nan' ? NaN : Number(v);
  }
  if (entry.type === 'str') return String(entry.value);
  throw new OnnxtrainError(`checkpoint: property ${JSON.stringify(name)} has unknown type ${JSON.stringify(entry.type)}`);
}

function writeProperty(name, value) {
  if (typeof value === 'string') return { type: 'str', value };
  if (typeof value !== 'number') {
    throw new OnnxtrainError(`property ${JSON.stringify(name)} is a ${typeof value}; properties hold numbers or strings`);
  }
  if (Number.isInteger(value)) return { type: 'int', value };
  const text = Number.isNaN(value) ? 'nan' : value === Infinity ? 'inf' : value === -Infinity ? '-inf' : String(value);
  return { type: 'float', value: text };
}

/** Parameters, requires-grad flags, optimizer state and properties: everything a checkpoint holds. */
export class CheckpointState {
  constructor({ parameters, optimizerStates = new Map(), optimizerStep = 0, learningRate = null,
                properties = {}, nominal = false }) {
    /** name -> {dtype, shape, data, requiresGrad}, in checkpoint order */
    this.parameters = parameters;
    this.savedOptimizerStates = optimizerStates; // param -> Map(state -> typed array), as loaded
    this.optimizerStep = optimizerStep;
    this.learningRate = learningRate;
    this.properties = { ...properties };
    this.isNominal = nominal;
    this.buffers = null; // set by the first Module
  }

  /** Read a checkpoint from its bytes (Uint8Array or ArrayBuffer) or fetch it from a URL. */
  static async loadCheckpoint(source) {
    if (typeof source === 'string' || source instanceof URL) {
      const response = await fetch(source);
      if (!response.ok) throw new OnnxtrainError(`cannot fetch the checkpoint ${source}: HTTP ${response.status}`);
      source = new Uint8Array(await response.arrayBuffer());
    }
    return CheckpointState.fromBytes(source);
  }

  static fromBytes(source) {
    const bytes = source instanceof Uint8Array ? source : new Uint8Array(source);
    if (bytes.length === 0) throw new OnnxtrainError('the checkpoint is empty: not an onnxtrain checkpoint');
    if (bytes.length < PREFIX || MAGIC.some((b, i) => bytes[i] !== b)) {
      throw new OnnxtrainError('not an onnxtrain checkpoint (it does not start with "OTCKPT\\r\\n"); pass the ' +
        'checkpoint written by generate_artifacts or saveCheckpoint, not a model file');
    }
    const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    const version = view.getUint32(8, true);
    if (version < 1 || version > FORMAT_VERSION) {
      throw new OnnxtrainError(`the checkpoint uses format version ${version}; this runtime reads 1 to ${FORMAT_VERSION}`);
    }
    const headerLength = Number(view.getBigUint64(16, true));
    if (PREFIX + headerLength > bytes.length) {
      throw new OnnxtrainError(`the checkpoint is truncated: its header claims ${headerLength} bytes, the file has ${bytes.length}`);
    }
    const blob = bytes.subarray(PREFIX, PREFIX + headerLength);
    if (crc32(blob) !== view.getUint32(12, true)) throw new OnnxtrainError('the checkpoint is damaged: the header checksum does not match');
    const header = JSON.parse(new TextDecoder().decode(blob));
    if (header.format !== 'onnxtrain.checkpoint') {
      throw new OnnxtrainError(`not an onnxtrain checkpoint (header format ${JSON.stringify(header.format)})`);
    }
    const start = alignUp(PREFIX + headerLength);
    if (bytes.length < start + (header.data_size || 0)) {
      throw new OnnxtrainError(`the checkpoint is truncated: ${bytes.length} bytes, the header describes ${start + header.data_size}`);
    }
    const nominal = Boolean(header.nominal);
    const parameters = new Map();
    for (const entry of header.parameters) {
      parameters.set(entry.name, {
        dtype: entry.dtype, shape: entry.shape.slice(), requiresGrad: Boolean(entry.requires_grad),
        data: readTensor(bytes, start, entry, `parameter ${JSON.stringify(entry.name)}`, nominal),
      });
    }
    const properties = {};
    for (const [k, v] of Object.entries(header.properties || {})) properties[k] = readProperty(k, v);
    const optimizerStates = new Map();
    let optimizerStep = 0;
    let learningRate = null;
    if (header.optimizer) {
      optimizerStep = header.optimizer.step;
      learningRate = header.optimizer.learning_rate ?? null;
      for (const [pname, states] of Object.entries(header.optimizer.states)) {
        const map = new Map();
        for (const [s, entry] of Object.entries(states)) {
          map.set(s, readTensor(bytes, start, entry, `optimizer state ${JSON.stringify(s)} of ${JSON.stringify(pname)}`, false));
        }
        optimizerStates.set(pname, map);
      }
    }
    return new CheckpointState({ parameters, optimizerStates, optimizerStep, learningRate, properties, nominal });
  }

  /** The checkpoint file's bytes; the optimizer state (step, learning rate, moments) only if asked. */
  static saveCheckpoint(state, includeOptimizerState = false) {
    if (!(state instanceof CheckpointState)) throw new OnnxtrainError('saveCheckpoint needs a CheckpointState');
    return state.toBytes(includeOptimizerState);
  }

  toBytes(includeOptimizerState = false) {
    const tensors = [];
    let dataSize = 0;
    const add = (dtype, shape, array) => {
      const offset = alignUp(dataSize);
      const raw = bytesOf(array);
      tensors.push([offset, raw]);
      dataSize = offset + raw.length;
      return { dtype, shape, offset, nbytes: raw.length, crc32: raw.length ? crc32(raw) : 0 };
    };
    const params = [];
    for (const [name, p] of this.parameters) {
      params.push({ name, requires_grad: p.requiresGrad, ...add(p.dtype, p.shape, this.array(name)) });
    }
    const properties = {};
    for (const [k, v] of Object.entries(this.properties)) properties[k] = writeProperty(k, v);
    const header = { format: 'onnxtrain.checkpoint', version: FORMAT_VERSION, nominal: false, parameters: params, properties };
    if (includeOptimizerState) {
      const states = {};
      for (const [pname, map] of this.optimizerStates()) {
        const p = this.parameters.get(pname);
        states[pname] = {};
        for (const [s, array] of map) states[pname][s] = add(p.dtype, p.shape, array);
      }
      header.optimizer = { step: this.optimizerStep, learning_rate: this.learningRate, states };
    }
    header.data_size = dataSize;
    const blob = new TextEncoder().encode(JSON.stringify(header));
    const start = alignUp(PREFIX + blob.length);
    const out = new Uint8Array(start + dataSize);
    out.set(MAGIC, 0);
    const view = new DataView(out.buffer);
    view.setUint32(8, FORMAT_VERSION, true);
    view.setUint32(12, crc32(blob), true);
    view.setBigUint64(16, BigInt(blob.length), true);
    out.set(blob, PREFIX);
    for (const [offset, raw] of tensors) out.set(raw, start + offset);
    return out;
  }

  /** The live data of parameter `name` (a view into the flat buffers once a Module trains it). */
  array(name) {
    if (this.buffers && this.buffers.layout.slices.has(name)) return this.buffers.paramView(name);
    const p = this.parameters.get(name);
    if (!p) throw new OnnxtrainError(`no parameter ${JSON.stringify(name)} in the checkpoint`);
    return p.data;
  }

  /** param -> Map(state -> typed array): the live buffers once an Optimizer runs, else as loaded. */
  optimizerStates() {
    if (this.buffers && this.buffers.stateNames().length) return this.buffers.stateViews();
    return this.savedOptimizerStates;
  }
}
