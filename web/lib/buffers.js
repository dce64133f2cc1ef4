// The flat buffers of a training run (docs/format.md, "Flat layout"): per element type one vector of
// trainable parameters, one of gradients and one per optimizer state, zero-padded to whole chunks. The
// optimizer model reads the live parameters and states and returns new ones, which become the live copy.
// This object also owns whether the gradients count as zero (after lazyResetGrad).
import { ARRAY_TYPES } from './checkpoint.js';
import { chunking, OnnxtrainError } from './format.js';

export class FlatLayout {
  constructor(names, parameters) {
    this.names = names.slice();
    this.dtypes = [];
    this.sizes = new Map();
    this.slices = new Map(); // name -> [dtype, lo, hi, shape]
    for (const name of names) {
      const { dtype, shape } = parameters.get(name);
      if (dtype !== 'float32') {
        throw new OnnxtrainError(`parameter ${JSON.stringify(name)} is ${dtype}; onnxtrain-web trains float32 parameters only`);
      }
      if (!this.sizes.has(dtype)) {
        this.sizes.set(dtype, 0);
        this.dtypes.push(dtype);
      }
      const lo = this.sizes.get(dtype);
      const hi = lo + shape.reduce((a, b) => a * b, 1);
      this.slices.set(name, [dtype, lo, hi, shape.slice()]);
      this.sizes.set(dtype, hi);
    }
  }

  rows(dtype) {
    return chunking(this.sizes.get(dtype));
  }

  newFlat() {
    const flat = new Map();
    for (const dtype of this.dtypes) {
      const [chunks, chunk] = this.rows(dtype);
      flat.set(dtype, new ARRAY_TYPES[dtype](chunks * chunk));
    }
    return flat;
  }

  view(flat, name) {
    const [dtype, lo, hi] = this.slices.get(name);
    return flat.get(dtype).subarray(lo, hi);
  }
}

export class FlatBuffers {
  constructor(layout, state) {
    this.layout = layout;
    this.params = layout.newFlat();
    for (const name of layout.names) this.paramView(name).set(state.parameters.get(name).data);
    this.grads = layout.newFlat();
    this.states = new Map(); // state name -> flat
    this.gradsZero = true; // gradients count as zero until a training step writes them
  }

  paramView(name) {
    return this.layout.view(this.params, name);
  }

  gradView(name) {
    return this.layout.view(this.grads, name);
  }

  addStates(names, saved) {
    for (const s of names) {
      if (this.states.has(s)) continue;
      const flat = this.layout.newFlat();
      for (const pname of this.layout.names) {
        const src = saved.get(pname)?.get(s);
        if (!src) continue;
        const view = this.layout.view(flat, pname);
        if (src.length !== view.length) {
          throw new OnnxtrainError(`the checkpoint's optimizer state ${JSON.stringify(s)} of ${JSON.stringify(pname)} has ` +
            `${src.length} elements, the parameter ${view.length}`);
        }
        view.set(src);
      }
      this.states.set(s, flat);
    }
  }

  stateNames() {
    return [...this.states.keys()];
  }

  stateViews() {
    const out = new Map();
    for (const pname of this.layout.names) {
      out.set(pname, new Map([...this.states].map(([s, flat]) => [s, this.layout.view(flat, pname)])));
    }
    return out;
  }

  /** The optimizer wrote new parameter and state vectors: they become the live copy. */
  swap(params, states) {
    this.params = params;
    for (const [s, flat] of states) this.states.set(s, flat);
  }

  resetGrad() {
    this.gradsZero = true;
  }

  /** The gradient vectors, zero-filled first if they were reset since the last training step. */
  gradsForUpdate() {
    if (this.gradsZero) {
      for (const flat of this.grads.values()) flat.fill(0);
      this.gradsZero = false;
    }
    return this.grads;
  }
}
