"""Eight-lane SIMD values for numba kernels: `f32x8` (float32) and `i32x8` (int32) that live in registers, and
`i16x16` (sixteen int16 lanes) for the integer dot products of the decode GEMV and the prefill GEMM; and their
sixteen-lane twins (`f32x16`, `i32x16`, `i16x32`: one AVX-512 register each) for the prefill GEMM's wide
micro-kernel and the GEMV's wide rows, whose operations (`madd`, `to_f32`, `fadd`, `fmul`, `fma`, `hsum`,
`store_f32`, and `iand` / `ishr` / ... on int16 lanes) take either width.

Why: numba widens every integer expression to 64 bits and LLVM's auto-vectoriser gives up on the short,
byte-shuffling loops of the GGUF block decoders (measured: 1 value/cycle, scalar or 4-lane code). These
intrinsics spell the vector code out instead, so a fused dequantize-dot runs at ~8-lane width (AVX2 on x86;
LLVM splits the vectors for narrower targets, so the code stays portable, only slower there).

Each function below is a numba intrinsic: call it only from @njit code. Loads take an array and an element
index and read `8` consecutive elements from there without bounds checks (callers keep indices in range).
Float arithmetic is plain IEEE float32, rounded after every operation like NumPy's, inside functions compiled
without fastmath: numba's fastmath pass puts its flags on every float instruction of a function that has none,
these included. Only `fma` (flagged `contract`) lets LLVM contract `a * b + c` into one instruction.
"""
from __future__ import annotations

import inspect

from llvmlite import binding, ir
from numba import types
from numba.core import config as numba_config
from numba.extending import intrinsic, models, register_model

LANES = 8

_I32 = ir.IntType(32)
_VF = ir.VectorType(ir.FloatType(), LANES)
_VI = ir.VectorType(_I32, LANES)
_I16 = ir.IntType(16)
_VW = ir.VectorType(_I16, 2 * LANES)
WIDE_LANES = 16
_VF16 = ir.VectorType(ir.FloatType(), WIDE_LANES)
_VI16 = ir.VectorType(_I32, WIDE_LANES)
_VW32 = ir.VectorType(_I16, 2 * WIDE_LANES)


class F32x8Type(types.Type):
    def __init__(self):
        super().__init__(name="f32x8")


class I32x8Type(types.Type):
    def __init__(self):
        super().__init__(name="i32x8")


class I16x16Type(types.Type):
    def __init__(self):
        super().__init__(name="i16x16")


class F32x16Type(types.Type):
    def __init__(self):
        super().__init__(name="f32x16")


class I32x16Type(types.Type):
    def __init__(self):
        super().__init__(name="i32x16")


class I16x32Type(types.Type):
    def __init__(self):
        super().__init__(name="i16x32")


f32x8 = F32x8Type()
i32x8 = I32x8Type()
i16x16 = I16x16Type()
f32x16 = F32x16Type()
i32x16 = I32x16Type()
i16x32 = I16x32Type()


@register_model(F32x8Type)
class _F32x8Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VF)


@register_model(I32x8Type)
class _I32x8Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VI)


@register_model(I16x16Type)
class _I16x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VW)


@register_model(F32x16Type)
class _F32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VF16)


@register_model(I32x16Type)
class _I32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VI16)


@register_model(I16x32Type)
class _I16x32Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VW32)


_INT_LANES = {i32x8: (_VI, types.int32), i16x16: (_VW, types.int16),  # lane type -> (LLVM vector, scalar)
              i16x32: (_VW32, types.int16), i32x16: (_VI16, types.int32)}
FLOAT_OF = {i32x8: f32x8, i32x16: f32x16}  # int32 lanes -> the float32 lanes of their width
PAIRS_OF = {i32x8: i16x16, i32x16: i16x32}  # int32 sums -> the int16 pairs `madd` multiplies into them


# --- helpers (code generation) ---------------------------------------------------------------------
def _lane_ptr(context, builder, arr_type, arr, index, lane_type, lanes=LANES):
    """Pointer to arr.data[index] as a pointer to a vector of `lanes` `lane_type`."""
    data = context.make_array(arr_type)(context, builder, arr).data
    return builder.bitcast(builder.gep(data, [index]), ir.VectorType(lane_type, lanes).as_pointer())


def _splat(builder, value, vec_type):
    vec = builder.insert_element(ir.Constant(vec_type, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, vec_type.count), [0] * vec_type.count))


def _int32(context, builder, value, value_type):
    return context.cast(builder, value, value_type, types.int32)


def _is_array(t, dtype):
    return isinstance(t, types.Array) and t.dtype == dtype and t.layout == "C"


def _is_int(t):
    return isinstance(t, types.Integer)


def _vector_load(arr, index, dtype, lane_type, lanes, result):
    """arr[index:index+lanes] of a `dtype` array as `result` lanes (the eight- and sixteen-lane loads)."""
    if not (_is_array(arr, dtype) and _is_int(index)):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_lane_ptr(context, builder, sig.args[0], args[0], args[1], lane_type, lanes),
                            align=dtype.bitwidth // 8)
    return result(arr, index), codegen


def _broadcast_load(arr, index, vec_type, result):
    """arr[index] of a float32 array in every lane of `vec_type`: one broadcast load, no index checks."""
    if not (_is_array(arr, types.float32) and _is_int(index)):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        return _splat(builder, builder.load(builder.gep(data, [args[1]]), align=4), vec_type)
    return result(arr, index), codegen


def _pair_broadcast(arr, index, pairs_type, result):
    """The int16 pair arr[index], arr[index+1] in every lane pair: one 32-bit broadcast (`pairs_type`: int32
    lanes, reinterpreted as the int16 pairs of `result`)."""
    if not (_is_array(arr, types.int16) and _is_int(index)):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        pair = builder.load(builder.bitcast(builder.gep(data, [args[1]]), _I32.as_pointer()), align=2)
        return builder.bitcast(_splat(builder, pair, pairs_type), context.get_value_type(result))
    return result(arr, index), codegen


def _constant(vec_type, value, result):
    def codegen(context, builder, sig, args):
        return ir.Constant(vec_type, [value] * vec_type.count)
    return result(), codegen


# --- loads -----------------------------------------------------------------------------------------
@intrinsic
def load_f32(typingctx, arr, index):
    """arr[index:index+8] of a float32 array."""
    return _vector_load(arr, index, types.float32, ir.FloatType(), LANES, f32x8)


def _byte_load(arr, index, extend, lanes=None):
    """Bytes arr[index:], as many as `lanes` (i32x8 by default, i16x16 or i16x32) has, widened by `extend`."""
    lanes = lanes or i32x8
    if not ((_is_array(arr, types.uint8) or _is_array(arr, types.int8)) and _is_int(index)):
        return None
    vec_type = _INT_LANES[lanes][0]

    def codegen(context, builder, sig, args):
        raw = builder.load(_lane_ptr(context, builder, sig.args[0], args[0], args[1], ir.IntType(8), vec_type.count),
                           align=1)
        return getattr(builder, extend)(raw, vec_type)
    return lanes(arr, index), codegen


@intrinsic
def load_u8(typingctx, arr, index):
    """arr[index:index+8] of a byte array, zero-extended to int32 lanes (0..255)."""
    return _byte_load(arr, index, "zext")


@intrinsic
def load_i8(typingctx, arr, index):
    """arr[index:index+8] of a byte array read as int8, sign-extended to int32 lanes (-128..127)."""
    return _byte_load(arr, index, "sext")


# --- integer lanes: int32 (i32x8) or int16 (i16x16), the same operations ---------------------------
def _int_binop(v, other, op):
    if not (v in _INT_LANES and (_is_int(other) or other == v)):
        return None
    vec_type, scalar = _INT_LANES[v]

    def codegen(context, builder, sig, args):
        rhs = args[1] if sig.args[1] == v else _splat(builder, context.cast(builder, args[1], sig.args[1], scalar),
                                                       vec_type)
        return getattr(builder, op)(args[0], rhs)
    return v(v, other), codegen


@intrinsic
def iand(typingctx, v, m):
    """v & m (m: lanes of v's type, or an integer for every lane)."""
    return _int_binop(v, m, "and_")


@intrinsic
def ior(typingctx, v, m):
    """v | m (m: lanes of v's type, or an integer for every lane)."""
    return _int_binop(v, m, "or_")


@intrinsic
def isub(typingctx, v, m):
    """v - m (m: lanes of v's type, or an integer for every lane)."""
    return _int_binop(v, m, "sub")


@intrinsic
def ishr(typingctx, v, s):
    """v >> s, logical (s: lanes of v's type, or an integer below the lane width for every lane)."""
    return _int_binop(v, s, "lshr")


@intrinsic
def ishl(typingctx, v, s):
    """v << s (s: lanes of v's type, or an integer below the lane width for every lane)."""
    return _int_binop(v, s, "shl")


@intrinsic
def halves(typingctx, low, high):
    """Lanes 0-3 of `low`, then lanes 4-7 of `high` (int32 lanes)."""
    if not (low == i32x8 and high == i32x8):
        return None

    def codegen(context, builder, sig, args):
        return builder.shuffle_vector(args[0], args[1], ir.Constant(_VI, [0, 1, 2, 3, 12, 13, 14, 15]))
    return i32x8(low, high), codegen


@intrinsic
def bit_lanes(typingctx, word, first_bit, value):
    """Lane i: `value` where bit (first_bit + i) of the 32-bit `word` is set, else 0 (first_bit + 7 <= 31)."""
    if not (_is_int(word) and _is_int(first_bit) and _is_int(value)):
        return None

    def codegen(context, builder, sig, args):
        w = _splat(builder, _int32(context, builder, args[0], sig.args[0]), _VI)
        first = _splat(builder, _int32(context, builder, args[1], sig.args[1]), _VI)
        shift = builder.add(first, ir.Constant(_VI, list(range(LANES))))
        bits = builder.and_(builder.lshr(w, shift), ir.Constant(_VI, [1] * LANES))
        return builder.mul(bits, _splat(builder, _int32(context, builder, args[2], sig.args[2]), _VI))
    return i32x8(word, first_bit, value), codegen


@intrinsic
def to_f32(typingctx, v):
    """int32 lanes -> float32 lanes of the same width (exact below 2**24)."""
    if v not in FLOAT_OF:
        return None

    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], context.get_value_type(sig.return_type))
    return FLOAT_OF[v](v), codegen


# --- float32 lanes ---------------------------------------------------------------------------------
@intrinsic
def zeros(typingctx):
    return _constant(_VF, 0.0, f32x8)


@intrinsic
def splat_at(typingctx, arr, index):
    """arr[index] (a float32 array) in all 8 lanes: one broadcast load, no index checks."""
    return _broadcast_load(arr, index, _VF, f32x8)


@intrinsic
def splat(typingctx, scalar):
    """`scalar` (cast to float32) in every lane."""
    return _scalar_splat(scalar, _VF, f32x8)


def _scalar_splat(scalar, vec_type, result):
    if not isinstance(scalar, (types.Float, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return _splat(builder, context.cast(builder, args[0], sig.args[0], types.float32), vec_type)
    return result(scalar), codegen


def _float_op(vs, build, widths=(f32x8,)):
    """An op on float32 lanes, all of one width among `widths` (the wide ones only where codegen is generic)."""
    if vs[0] not in widths or any(v != vs[0] for v in vs):
        return None

    def codegen(context, builder, sig, args):
        return build(builder, *args)
    return vs[0](*vs), codegen


@intrinsic
def fadd(typingctx, x, y):
    """x + y (either width)"""
    return _float_op((x, y), lambda b, x, y: b.fadd(x, y), (f32x8, f32x16))


@intrinsic
def fsub(typingctx, x, y):
    """x - y (either width)"""
    return _float_op((x, y), lambda b, x, y: b.fsub(x, y), (f32x8, f32x16))


@intrinsic
def fmul(typingctx, x, y):
    """x * y (either width)"""
    return _float_op((x, y), lambda b, x, y: b.fmul(x, y), (f32x8, f32x16))


@intrinsic
def fma(typingctx, x, y, z):
    """x * y + z (one fused instruction where the target has FMA; either width)."""
    return _float_op((x, y, z), lambda b, x, y, z: b.fadd(b.fmul(x, y, flags=("contract",)), z, flags=("contract",)),
                     (f32x8, f32x16))


def _call_float_intrinsic(builder, name, *operands):
    """The LLVM intrinsic `name` (llvm.fabs, llvm.minnum, ...) on float32 vectors of the operands' width."""
    vec_type = operands[0].type
    fnty = ir.FunctionType(vec_type, [vec_type] * len(operands))
    return builder.call(builder.module.declare_intrinsic(f"{name}.v{vec_type.count}f32", fnty=fnty), list(operands))


def _float_intrinsic(name, vs):
    return _float_op(vs, lambda builder, *args: _call_float_intrinsic(builder, name, *args), (f32x8, f32x16))


@intrinsic
def fabs(typingctx, x):
    """|x|"""
    return _float_intrinsic("llvm.fabs", (x,))


@intrinsic
def fmax(typingctx, x, y):
    """max(x, y) per lane (IEEE maxNum: a NaN lane takes the other operand)."""
    return _float_intrinsic("llvm.maxnum", (x, y))


@intrinsic
def fmin(typingctx, x, y):
    """min(x, y) per lane (IEEE minNum)."""
    return _float_intrinsic("llvm.minnum", (x, y))


@intrinsic
def fround(typingctx, x):
    """x rounded to the nearest integer, ties to even (np.rint), as float32 lanes."""
    return _float_intrinsic("llvm.roundeven", (x,))


# exp's range reduction and polynomial (Cephes expf: e^x = 2^n * e^r, |r| <= ln(2) / 2, ln 2 split in two so
# that n * ln 2 is exact to float32; the degree-7 polynomial is within 1.2e-7 relative of e^r)
_LOG2E = 1.44269504088896341
_LN2_HIGH, _LN2_LOW = 0.693359375, -2.12194440e-4
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
EXP_SMALLEST_X = -87.33654  # ln(2**-126): below it (-inf included) fexp gives 0, the normal floats' end


@intrinsic
def fexp(typingctx, x):
    """e^x per lane (either width), within 2e-7 relative of math.exp for x >= EXP_SMALLEST_X; 0 below it (a
    softmax's masked scores, -inf, come out 0), NaN kept. Plain float32 operations, so a vector of softmax
    weights costs a few instructions per 16 lanes where math.exp is a libm call per value."""
    if x not in (f32x8, f32x16):
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        vec_type = v.type
        lanes = vec_type.count
        int_type = ir.VectorType(_I32, lanes)

        def c(value):
            return ir.Constant(vec_type, [value] * lanes)

        small = builder.fcmp_ordered("<", v, c(EXP_SMALLEST_X))
        nan = builder.fcmp_unordered("uno", v, v)
        finite_x = builder.select(small, c(0.0), v)
        clamped = _call_float_intrinsic(builder, "llvm.minnum", finite_x, c(88.37))  # (2^127 at most: finite)
        n = _call_float_intrinsic(builder, "llvm.roundeven", builder.fmul(clamped, c(_LOG2E)))
        r = builder.fsub(builder.fsub(clamped, builder.fmul(n, c(_LN2_HIGH))), builder.fmul(n, c(_LN2_LOW)))
        poly = c(_EXP_POLY[0])
        for coefficient in _EXP_POLY[1:]:
            poly = builder.fadd(builder.fmul(poly, r), c(coefficient))
        e_r = builder.fadd(builder.fadd(builder.fmul(builder.fmul(poly, r), r), r), c(1.0))
        exponent = builder.shl(builder.add(builder.fptosi(n, int_type), ir.Constant(int_type, [127] * lanes)),
                               ir.Constant(int_type, [23] * lanes))
        y = builder.fmul(e_r, builder.bitcast(exponent, vec_type))
        return builder.select(nan, v, builder.select(small, c(0.0), y))
    return x(x), codegen


@intrinsic
def hmax(typingctx, v):
    """The largest of the 8 (or 16) lanes as float32."""
    if v not in (f32x8, f32x16):
        return None
    lanes = LANES if v == f32x8 else WIDE_LANES

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.FloatType(), [_VF if v == f32x8 else _VF16])
        return builder.call(builder.module.declare_intrinsic(f"llvm.vector.reduce.fmax.v{lanes}f32", fnty=fnty),
                            [args[0]])
    return types.float32(v), codegen


@intrinsic
def hsum(typingctx, v):
    """Sum of the 8 lanes as float32 (pairwise: (l0+l4 + l2+l6) + (l1+l5 + l3+l7)); of 16, lanes i and i + 8
    added first."""
    if v not in (f32x8, f32x16):
        return None

    def codegen(context, builder, sig, args):
        def half(vec, lanes):
            return builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, len(lanes)), lanes))
        s8 = args[0] if v == f32x8 else builder.fadd(half(args[0], list(range(8))), half(args[0], list(range(8, 16))))
        s4 = builder.fadd(half(s8, [0, 1, 2, 3]), half(s8, [4, 5, 6, 7]))
        s2 = builder.fadd(half(s4, [0, 1]), half(s4, [2, 3]))
        return builder.fadd(builder.extract_element(s2, ir.Constant(_I32, 0)),
                            builder.extract_element(s2, ir.Constant(_I32, 1)))
    return types.float32(v), codegen


@intrinsic
def hsums_16(typingctx, p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15):
    """Lane t: the sum of p_t's sixteen lanes, bit for bit `hsum`'s (lanes i and i + 8 first, then i + 4, i + 2,
    i + 1), the sixteen sums in one tree: each level adds two vectors' halves in one add, so 15 adds and 30
    two-source shuffles make all sixteen, where one hsum alone takes 4 adds and 4 shuffles."""
    vs = (p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15)
    if not all(v == f32x16 for v in vs):
        return None

    def codegen(context, builder, sig, args):
        def pair_sums(x, y, first, second):  # x's and y's lanes `first` + their lanes `second` (of 32)
            def pick(lanes):
                return builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(_I32, len(lanes)), lanes))
            return builder.fadd(pick(first), pick(second))
        level = list(args)
        # each level: a vector holds 2, 4, 8, then 16 of the p's, each p in 8, 4, 2, then 1 lanes
        for width in (8, 4, 2, 1):
            first = [base + o for base in range(0, 32, 2 * width) for o in range(width)]
            level = [pair_sums(level[m], level[m + 1], first, [f + width for f in first])
                     for m in range(0, len(level), 2)]
        return level[0]
    return f32x16(*vs), codegen


@intrinsic
def store_f32_where(typingctx, arr, index, v, bits):
    """arr[index + t] = lane t of the sixteen-lane v where bit t of the integer `bits` is set; the other elements
    untouched and not accessed (one masked store: lanes past the array's end may be masked off)."""
    if not (_is_array(arr, types.float32) and _is_int(index) and v == f32x16 and _is_int(bits)):
        return None

    def codegen(context, builder, sig, args):
        pointer = _lane_ptr(context, builder, sig.args[0], args[0], args[1], ir.FloatType(), WIDE_LANES)
        mask_type = ir.VectorType(ir.IntType(1), WIDE_LANES)
        mask = builder.bitcast(builder.trunc(context.cast(builder, args[3], sig.args[3], types.int64),
                                             ir.IntType(WIDE_LANES)), mask_type)
        fnty = ir.FunctionType(ir.VoidType(), [_VF16, pointer.type, _I32, mask_type])
        suffix = "p0" if getattr(pointer.type, "is_opaque", False) else "p0v16f32"  # (typed pointers: LLVM < 17)
        store = builder.module.declare_intrinsic(f"llvm.masked.store.v16f32.{suffix}", fnty=fnty)
        builder.call(store, [args[2], pointer, ir.Constant(_I32, 4), mask])
        return context.get_dummy_value()
    return types.none(arr, index, v, bits), codegen


@intrinsic
def pair_lanes(typingctx, v):
    """Lanes 0, 0, 1, 1, 2, 2, 3, 3 of v."""
    if v != f32x8:
        return None

    def codegen(context, builder, sig, args):
        return builder.shuffle_vector(args[0], args[0], ir.Constant(_VI, [0, 0, 1, 1, 2, 2, 3, 3]))
    return f32x8(v), codegen


@intrinsic
def lane_splat(typingctx, v, lane):
    """Lane `lane` of v (a constant 0..7 once unrolled) in every lane."""
    return _lane_broadcast(v, lane, _VF, f32x8)


def _lane_broadcast(v, lane, vec_type, result):
    if not (v == f32x8 and _is_int(lane)):
        return None

    def codegen(context, builder, sig, args):
        value = builder.extract_element(args[0], _int32(context, builder, args[1], sig.args[1]))
        return _splat(builder, value, vec_type)
    return result(v, lane), codegen


@intrinsic
def store_f32(typingctx, arr, index, v):
    """arr[index:index+8] = v, or arr[index:index+16] for sixteen lanes (float32 array)."""
    if not (_is_array(arr, types.float32) and _is_int(index) and v in (f32x8, f32x16)):
        return None
    lanes = LANES if v == f32x8 else WIDE_LANES

    def codegen(context, builder, sig, args):
        builder.store(args[2], _lane_ptr(context, builder, sig.args[0], args[0], args[1], ir.FloatType(), lanes),
                      align=4)
        return context.get_dummy_value()
    return types.none(arr, index, v), codegen


@intrinsic
def f32_from_bits(typingctx, bits):
    """The float32 whose IEEE bit pattern is the low 32 bits of the integer `bits` (a scalar bitcast)."""
    if not _is_int(bits):
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(_int32(context, builder, args[0], sig.args[0]), ir.FloatType())
    return types.float32(bits), codegen


@intrinsic
def prefetch(typingctx, arr, index):
    """Ask for the cache line of arr.data[index] (a byte array) ahead of its use; any index is safe (a prefetch
    never faults), so kernels may name bytes past the row they read, the next row's."""
    if not ((_is_array(arr, types.uint8) or _is_array(arr, types.int8)) and _is_int(index)):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        address = builder.gep(data, [args[1]])
        fnty = ir.FunctionType(ir.VoidType(), [address.type, _I32, _I32, _I32])
        intrinsic_fn = builder.module.declare_intrinsic("llvm.prefetch", [address.type], fnty=fnty)
        builder.call(intrinsic_fn, [address, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()
    return types.none(arr, index), codegen


# --- int16 lanes: the integer dot products of the decode GEMV and the prefill GEMM ------------------
# Weight codes (at most 8 bits) times 16-bit activation codes, pairs summed into int32 lanes: LLVM turns
# `madd` into one vpmaddwd (AVX2) or vpdpwssd (AVX-512 VNNI / AVX-VNNI), 16 products an instruction.

@intrinsic
def load_u8w(typingctx, arr, index):
    """arr[index:index+16] of a byte array, zero-extended to int16 lanes (0..255)."""
    return _byte_load(arr, index, "zext", i16x16)


@intrinsic
def load_i8w(typingctx, arr, index):
    """arr[index:index+16] of a byte array read as int8, sign-extended to int16 lanes (-128..127)."""
    return _byte_load(arr, index, "sext", i16x16)


@intrinsic
def load_i16(typingctx, arr, index):
    """arr[index:index+16] of an int16 array."""
    return _vector_load(arr, index, types.int16, _I16, 2 * LANES, i16x16)


@intrinsic
def bit_words(typingctx, word, first_bit, value):
    """Lane i of 16: `value` where bit (first_bit + i) of the 32-bit `word` is set, else 0 (first_bit + 15 <= 31)."""
    if not (_is_int(word) and _is_int(first_bit) and _is_int(value)):
        return None

    def codegen(context, builder, sig, args):
        w = builder.trunc(builder.lshr(_int32(context, builder, args[0], sig.args[0]),
                                       _int32(context, builder, args[1], sig.args[1])), _I16)
        lane_bits = [1 << i if i < 15 else -(1 << 15) for i in range(2 * LANES)]  # (bit 15 as an int16: negative)
        bits = builder.and_(_splat(builder, w, _VW), ir.Constant(_VW, lane_bits))
        is_set = builder.icmp_unsigned("!=", bits, ir.Constant(_VW, [0] * (2 * LANES)))
        value = _splat(builder, builder.trunc(_int32(context, builder, args[2], sig.args[2]), _I16), _VW)
        return builder.select(is_set, value, ir.Constant(_VW, [0] * (2 * LANES)))
    return i16x16(word, first_bit, value), codegen


@intrinsic
def store_i16(typingctx, arr, index, v):
    """arr[index:index+8] = v for float32 lanes holding integers in int16's range, or arr[index:index+16] = v
    for int16 lanes (arr[index:index+32] for 32 of them; int16 array)."""
    if not (_is_array(arr, types.int16) and _is_int(index) and v in (f32x8, i16x16, i16x32)):
        return None

    def codegen(context, builder, sig, args):
        if sig.args[2] == f32x8:
            words, lanes = builder.fptosi(args[2], ir.VectorType(_I16, LANES)), LANES
        else:
            words, lanes = args[2], 2 * LANES if sig.args[2] == i16x16 else 2 * WIDE_LANES
        builder.store(words, _lane_ptr(context, builder, sig.args[0], args[0], args[1], _I16, lanes), align=2)
        return context.get_dummy_value()
    return types.none(arr, index, v), codegen


@intrinsic
def splat_pair(typingctx, arr, index):
    """The int16 pair arr[index], arr[index+1] in each of the 8 lane pairs of an i16x16 (one 32-bit broadcast):
    `madd` of it with 8 other pairs multiplies that one pair into 8 sums at once."""
    return _pair_broadcast(arr, index, _VI, i16x16)


@intrinsic
def izeros(typingctx):
    """int32 zeros."""
    return _constant(_VI, 0, i32x8)


@intrinsic
def madd(typingctx, acc, a, b):
    """acc + (a[2i] * b[2i] + a[2i+1] * b[2i+1]) in int32 lane i (exact while the sums fit in int32); eight
    lanes, or sixteen (one vpdpwssd on a 512-bit register)."""
    if not (acc in PAIRS_OF and a == PAIRS_OF[acc] and b == a):
        return None
    lanes = LANES if acc == i32x8 else WIDE_LANES

    def codegen(context, builder, sig, args):
        wide = ir.VectorType(_I32, 2 * lanes)
        prod = builder.mul(builder.sext(args[1], wide), builder.sext(args[2], wide))
        pick = ir.VectorType(_I32, lanes)
        even = builder.shuffle_vector(prod, prod, ir.Constant(pick, list(range(0, 2 * lanes, 2))))
        odd = builder.shuffle_vector(prod, prod, ir.Constant(pick, list(range(1, 2 * lanes, 2))))
        return builder.add(args[0], builder.add(even, odd))
    return acc(acc, a, b), codegen


# --- sixteen lanes: the wide GEMM micro-kernel and the wide GEMV (AVX-512) ------------------------
# Loads of twice the width: one 512-bit register each. On a target without 512-bit registers LLVM splits them
# in two (correct, but slower and short of registers), so the wide kernels run only where MACHINE_HAS_512_BIT_LANES.

def _has_512_bit_lanes() -> bool:
    """Whether numba's target has AVX-512 BW (512-bit integer lanes): the machine's, or NUMBA_CPU_FEATURES's."""
    if numba_config.CPU_FEATURES:  # (a user compiling for another target: its features decide)
        return "+avx512bw" in numba_config.CPU_FEATURES.split(",")
    try:
        return bool(binding.get_host_cpu_features().get("avx512bw"))
    except RuntimeError:  # (LLVM cannot read this host's features: the portable kernels)
        return False


MACHINE_HAS_512_BIT_LANES = _has_512_bit_lanes()


@intrinsic
def zeros_16(typingctx):
    """float32 zeros, sixteen lanes."""
    return _constant(_VF16, 0.0, f32x16)


@intrinsic
def izeros_16(typingctx):
    """int32 zeros, sixteen lanes."""
    return _constant(_VI16, 0, i32x16)


@intrinsic
def load_f32_16(typingctx, arr, index):
    """arr[index:index+16] of a float32 array."""
    return _vector_load(arr, index, types.float32, ir.FloatType(), WIDE_LANES, f32x16)


@intrinsic
def splat_at_16(typingctx, arr, index):
    """arr[index] (a float32 array) in all 16 lanes."""
    return _broadcast_load(arr, index, _VF16, f32x16)


@intrinsic
def load_i16_32(typingctx, arr, index):
    """arr[index:index+32] of an int16 array."""
    return _vector_load(arr, index, types.int16, _I16, 2 * WIDE_LANES, i16x32)


@intrinsic
def splat_pair_32(typingctx, arr, index):
    """The int16 pair arr[index], arr[index+1] in each of the 16 lane pairs of an i16x32 (`splat_pair`, wide)."""
    return _pair_broadcast(arr, index, _VI16, i16x32)


@intrinsic
def lane_splat_16(typingctx, v, lane):
    """Lane `lane` of the eight-lane v (a constant 0..7 once unrolled) in all 16 lanes."""
    return _lane_broadcast(v, lane, _VF16, f32x16)


@intrinsic
def load_u16_32(typingctx, arr, index):
    """The 32 little-endian 16-bit words at byte `index` of a byte array, as int16 lanes (their bits)."""
    if not (_is_array(arr, types.uint8) and _is_int(index)):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_lane_ptr(context, builder, sig.args[0], args[0], args[1], _I16, 2 * WIDE_LANES), align=1)
    return i16x32(arr, index), codegen


@intrinsic
def load_u8w_32(typingctx, arr, index):
    """arr[index:index+32] of a byte array, zero-extended to int16 lanes (0..255)."""
    return _byte_load(arr, index, "zext", i16x32)


@intrinsic
def load_i8w_32(typingctx, arr, index):
    """arr[index:index+32] of a byte array read as int8, sign-extended to int16 lanes (-128..127)."""
    return _byte_load(arr, index, "sext", i16x32)


@intrinsic
def splat_16(typingctx, scalar):
    """`scalar` (cast to float32) in all 16 lanes."""
    return _scalar_splat(scalar, _VF16, f32x16)


@intrinsic
def lane_pair_splat_16(typingctx, v, lane):
    """Lane `lane` of the eight-lane v in lanes 0-7, lane `lane + 1` in lanes 8-15: the scales of two 16-value
    groups beside each other, as `madd` of 32 values leaves their sums (Q6_K: a scale per 16 values)."""
    if not (v == f32x8 and _is_int(lane)):
        return None

    def codegen(context, builder, sig, args):
        first = _int32(context, builder, args[1], sig.args[1])
        low = _splat(builder, builder.extract_element(args[0], first), _VF)
        high = _splat(builder, builder.extract_element(args[0], builder.add(first, ir.Constant(_I32, 1))), _VF)
        return builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(_I32, WIDE_LANES), list(range(16))))
    return f32x16(v, lane), codegen


@intrinsic
def join_32(typingctx, low, high):
    """The sixteen int16 lanes of `low`, then those of `high`: one i16x32."""
    if not (low == i16x16 and high == i16x16):
        return None

    def codegen(context, builder, sig, args):
        return builder.shuffle_vector(args[0], args[1], ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
    return i16x32(low, high), codegen


@intrinsic
def bit_words_32(typingctx, word, value):
    """Lane i of 32: `value` where bit i of the 32-bit `word` is set, else 0 (`bit_words` for all 32 bits)."""
    if not (_is_int(word) and _is_int(value)):
        return None

    def codegen(context, builder, sig, args):
        # (the word as 32 one-bit lanes, bit i lane i: with AVX-512 one mask register and a masked move)
        is_set = builder.bitcast(_int32(context, builder, args[0], sig.args[0]), ir.VectorType(ir.IntType(1), 32))
        value = _splat(builder, builder.trunc(_int32(context, builder, args[1], sig.args[1]), _I16), _VW32)
        return builder.select(is_set, value, ir.Constant(_VW32, [0] * 32))
    return i16x32(word, value), codegen


# --- sixteen values of an encoded KV row (ops/kv_formats/cpu.py decode_row_at: the CPU's decode attention) -----------
@intrinsic
def load_u8_16(typingctx, arr, index):
    """arr[index:index+16] of a byte array, zero-extended to sixteen int32 lanes (0..255)."""
    return _byte_load(arr, index, "zext", i32x16)


@intrinsic
def load_i8_16(typingctx, arr, index):
    """arr[index:index+16] of a byte array read as int8, sign-extended to sixteen int32 lanes (-128..127)."""
    return _byte_load(arr, index, "sext", i32x16)


def _u16_lanes(context, builder, sig, args):
    """The 16 little-endian uint16 at byte args[1] of the byte array args[0], zero-extended to int32 lanes."""
    raw = builder.load(_lane_ptr(context, builder, sig.args[0], args[0], args[1], ir.IntType(8), 32), align=1)
    return builder.zext(builder.bitcast(raw, ir.VectorType(_I16, WIDE_LANES)), _VI16)


def _u16_load(arr, index, convert):
    if not (_is_array(arr, types.uint8) and _is_int(index)):
        return None

    def codegen(context, builder, sig, args):
        return convert(builder, _u16_lanes(context, builder, sig, args))
    return f32x16(arr, index), codegen


def _i32_constant(value):
    return ir.Constant(_VI16, [value] * WIDE_LANES)


def _halves_to_f32(builder, h):
    """IEEE half bits (int32 lanes) -> float32, exactly as NumPy's astype: the magnitude's bits moved up into a
    float32 and scaled by 2^112 (exact, subnormal halves included), the infinities and NaNs (exponent 31, payload
    kept) then given float32's all-ones exponent, the sign put back."""
    magnitude = builder.bitcast(builder.shl(builder.and_(h, _i32_constant(0x7FFF)), _i32_constant(13)), _VF16)
    scaled = builder.bitcast(builder.fmul(magnitude, ir.Constant(_VF16, [2.0 ** 112] * WIDE_LANES)), _VI16)
    special = builder.icmp_unsigned(">=", builder.and_(h, _i32_constant(0x7C00)), _i32_constant(0x7C00))
    exponent = builder.select(special, _i32_constant(0x7F800000), _i32_constant(0))
    sign = builder.shl(builder.and_(h, _i32_constant(0x8000)), _i32_constant(16))
    return builder.bitcast(builder.or_(builder.or_(scaled, exponent), sign), _VF16)


def _halves_to_f32_fast(builder, h):
    """_halves_to_f32 by the hardware's conversion (one vcvtph2ps where the CPU has F16C / AVX-512), which is
    exact for every half but a signalling NaN: it quiets those (NumPy keeps them as they are). So when a lane
    is NaN, a branch that is as good as never taken converts the sixteen again bit by bit."""
    fast = builder.fpext(builder.bitcast(builder.trunc(h, ir.VectorType(_I16, WIDE_LANES)),
                                         ir.VectorType(ir.HalfType(), WIDE_LANES)), _VF16)
    lane_mask = ir.IntType(WIDE_LANES)
    nan_lanes = builder.bitcast(builder.fcmp_unordered("uno", fast, fast), lane_mask)
    any_nan = builder.icmp_unsigned("!=", nan_lanes, ir.Constant(lane_mask, 0))
    checked = builder.block
    with builder.if_then(any_nan, likely=False):
        exact = _halves_to_f32(builder, h)
        converted = builder.block
    result = builder.phi(_VF16)
    result.add_incoming(fast, checked)
    result.add_incoming(exact, converted)
    return result


@intrinsic
def load_f16_16(typingctx, arr, index):
    """The 16 fp16 values at byte `index` of a byte array as float32 lanes, bit for bit NumPy's astype (NaN
    payloads kept)."""
    return _u16_load(arr, index, _halves_to_f32_fast)


@intrinsic
def load_bf16_16(typingctx, arr, index):
    """The 16 bfloat16 values at byte `index` of a byte array as float32 lanes (their bits, 16 places up)."""
    return _u16_load(arr, index, lambda builder, h: builder.bitcast(builder.shl(h, _i32_constant(16)), _VF16))


@intrinsic
def bit_lanes_16(typingctx, word, first_bit, value):
    """Lane i of 16: `value` where bit (first_bit + i) of the 32-bit `word` is set, else 0 (first_bit + 15 <= 31)."""
    if not (_is_int(word) and _is_int(first_bit) and _is_int(value)):
        return None

    def codegen(context, builder, sig, args):
        w = _splat(builder, _int32(context, builder, args[0], sig.args[0]), _VI16)
        first = _splat(builder, _int32(context, builder, args[1], sig.args[1]), _VI16)
        shift = builder.add(first, ir.Constant(_VI16, list(range(WIDE_LANES))))
        bits = builder.and_(builder.lshr(w, shift), _i32_constant(1))
        return builder.mul(bits, _splat(builder, _int32(context, builder, args[2], sig.args[2]), _VI16))
    return i32x16(word, first_bit, value), codegen


@intrinsic
def bit_fields_16(typingctx, word, step, mask):
    """Lane i of 16: (word >> (i * step)) & mask of the 64-bit `word`: sixteen packed indices `step` bits apart
    (15 * step + bits of mask <= 64)."""
    if not all(_is_int(a) for a in (word, step, mask)):
        return None

    def codegen(context, builder, sig, args):
        i64, lanes64 = ir.IntType(64), ir.VectorType(ir.IntType(64), WIDE_LANES)
        word_, step_ = (context.cast(builder, a, t, types.int64) for a, t in zip(args[:2], sig.args[:2]))
        shift = builder.mul(ir.Constant(lanes64, list(range(WIDE_LANES))), _splat(builder, step_, lanes64))
        fields = builder.trunc(builder.lshr(_splat(builder, word_, lanes64), shift), _VI16)
        return builder.and_(fields, _splat(builder, _int32(context, builder, args[2], sig.args[2]), _VI16))
    return i32x16(word, step, mask), codegen


def _scalar_load(arr, index, width):
    """The little-endian `width`-bit unsigned integer at byte `index` of a byte array (no bounds checks)."""
    if not ((_is_array(arr, types.uint8) or _is_array(arr, types.int8)) and _is_int(index)):
        return None
    result = types.uint64 if width == 64 else types.int64

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        address = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(width).as_pointer())
        value = builder.load(address, align=1)
        return value if width == 64 else builder.zext(value, ir.IntType(64))
    return result(arr, index), codegen


@intrinsic
def load_u16(typingctx, arr, index):
    """The uint16 at byte `index` of a byte array (unaligned, little-endian: x86 and ARM), as an int64."""
    return _scalar_load(arr, index, 16)


@intrinsic
def load_u32(typingctx, arr, index):
    """The uint32 at byte `index` of a byte array, as an int64."""
    return _scalar_load(arr, index, 32)


@intrinsic
def load_u64(typingctx, arr, index):
    """The uint64 at byte `index` of a byte array."""
    return _scalar_load(arr, index, 64)


# llvmlite's GEPInstr names the element type itself (so that a vector of indices can be given) from 0.44 on
_VECTOR_GEP = "source_etype" in inspect.signature(ir.instructions.GEPInstr.__init__).parameters


def _lane_pointers(builder, data, indices):
    """<16 x float*>: data + indices[i] in lane i. A vector GEP, which LLVM makes one vgatherdps (llvmlite's
    builder.gep types only scalar indices, so the instruction is built by hand); with an older llvmlite, from
    integer addresses (two 8-lane gathers)."""
    vector_type = ir.VectorType(data.type, WIDE_LANES)
    if not _VECTOR_GEP:
        i64s = ir.VectorType(ir.IntType(64), WIDE_LANES)
        base = _splat(builder, builder.ptrtoint(data, ir.IntType(64)), i64s)
        offsets = builder.shl(builder.sext(indices, i64s), ir.Constant(i64s, [2] * WIDE_LANES))
        return builder.inttoptr(builder.add(base, offsets), vector_type)
    pointers = ir.instructions.GEPInstr(builder.block, data, [indices], inbounds=True, name="",
                                        source_etype=ir.FloatType())
    pointers.type = vector_type
    builder._insert(pointers)
    return pointers


@intrinsic
def gather_16(typingctx, table, indices):
    """table[indices[i]] in lane i (a float32 array, int32 lanes in its range: no bounds checks)."""
    if not (_is_array(table, types.float32) and indices == i32x16):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        pointers = _lane_pointers(builder, data, args[1])
        fnty = ir.FunctionType(_VF16, [pointers.type, _I32, ir.VectorType(ir.IntType(1), WIDE_LANES), _VF16])
        suffix = "v16p0" if getattr(data.type, "is_opaque", False) else "v16p0f32"  # (typed pointers: LLVM < 17)
        gather = builder.module.declare_intrinsic(f"llvm.masked.gather.v16f32.{suffix}", fnty=fnty)
        return builder.call(gather, [pointers, ir.Constant(_I32, 4),
                                     ir.Constant(ir.VectorType(ir.IntType(1), WIDE_LANES), [1] * WIDE_LANES),
                                     ir.Constant(_VF16, ir.Undefined)])
    return f32x16(table, indices), codegen


@intrinsic
def borrow(typingctx, arr):
    """arr without its reference count: the same data, shape and strides, no owner. numba counts references to
    every array a function gives an inlined helper, with atomic operations that it often cannot prune out of a
    loop with branches (measured: 14 a row, 90% of a row decode's time, the cores contending for the counts'
    cache lines); a borrowed array's count is a null test. The caller keeps the owner alive meanwhile."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, sig, args):
        view = context.make_array(sig.args[0])(context, builder, value=args[0])
        view.meminfo = ir.Constant(view.meminfo.type, None)
        view.parent = ir.Constant(view.parent.type, None)
        return view._getvalue()
    return arr(arr), codegen


@intrinsic
def lookup_16(typingctx, table, indices):
    """table[indices[i] & 15] in lane i, `table` sixteen float32 lanes (a level table in a register): one vpermps
    with AVX-512, a table spilled and gathered elsewhere."""
    if not (table == f32x16 and indices == i32x16):
        return None

    def codegen(context, builder, sig, args):
        wrapped = builder.and_(args[1], _i32_constant(15))
        if MACHINE_HAS_512_BIT_LANES:
            fnty = ir.FunctionType(_VF16, [_VF16, _VI16])
            permute = builder.module.declare_intrinsic("llvm.x86.avx512.permvar.sf.512", fnty=fnty)
            return builder.call(permute, [args[0], wrapped])
        value = ir.Constant(_VF16, ir.Undefined)
        for lane in range(WIDE_LANES):  # (LLVM turns this into shuffles or a gather where it can)
            at = ir.Constant(_I32, lane)
            value = builder.insert_element(value, builder.extract_element(
                args[0], builder.extract_element(wrapped, at)), at)
        return value
    return f32x16(table, indices), codegen


@intrinsic
def butterflies_16(typingctx, v):
    """The Walsh-Hadamard butterfly stages h = 1, 2, 4, 8 of sixteen float32 lanes, in that order: lane i with bit h
    clear becomes v[i] + v[i + h], its partner v[i] - v[i + h] (ops/kv_formats/turbo.py fwht_unnormalised, the same roundings)."""
    if v != f32x16:
        return None

    def codegen(context, builder, sig, args):
        x = args[0]
        for h in (1, 2, 4, 8):
            partner = builder.shuffle_vector(x, x, ir.Constant(_VI16, [i ^ h for i in range(WIDE_LANES)]))
            high = ir.Constant(ir.VectorType(ir.IntType(1), WIDE_LANES), [(i & h) != 0 for i in range(WIDE_LANES)])
            x = builder.select(high, builder.fsub(partner, x), builder.fadd(x, partner))
        return x
    return f32x16(v), codegen


# --- byte lanes: the VNNI decode GEMV (ops/matmul/cpu_gemv.py, Q4_K / Q5_K) --------------------------------
# 64 byte lanes travel as an i32x16 (one 512-bit register): vpdpbusd multiplies them four to an int32 lane.

def _has_vnni() -> bool:
    """Whether numba's target has AVX-512 VNNI beside AVX-512 BW (vpdpbusd on 512-bit registers)."""
    if numba_config.CPU_FEATURES:
        features = numba_config.CPU_FEATURES.split(",")
        return "+avx512vnni" in features and "+avx512bw" in features
    try:
        features = binding.get_host_cpu_features()
    except RuntimeError:
        return False
    return bool(features.get("avx512vnni") and features.get("avx512bw"))


MACHINE_HAS_VNNI = _has_vnni()
_VB32 = ir.VectorType(ir.IntType(8), 32)


@intrinsic
def load_bytes_64(typingctx, arr, index):
    """arr[index:index+64] of a byte array as 64 byte lanes (an i32x16)."""
    if not ((_is_array(arr, types.uint8) or _is_array(arr, types.int8)) and _is_int(index)):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_lane_ptr(context, builder, sig.args[0], args[0], args[1], _I32, WIDE_LANES), align=1)
    return i32x16(arr, index), codegen


def _nibble_lanes(builder, low, high):
    """The 32 bytes of `low`, then the 32 of `high`, as an i32x16."""
    both = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(_I32, 64), list(range(64))))
    return builder.bitcast(both, _VI16)


@intrinsic
def load_nibbles_64(typingctx, arr, index):
    """The low nibbles of the 32 bytes arr[index:index+32] in byte lanes 0-31, their high nibbles in lanes 32-63
    (a Q4_K / Q5_K pair of sub-blocks, in the order of its values)."""
    if not (_is_array(arr, types.uint8) and _is_int(index)):
        return None

    def codegen(context, builder, sig, args):
        v = builder.load(_lane_ptr(context, builder, sig.args[0], args[0], args[1], ir.IntType(8), 32), align=1)
        return _nibble_lanes(builder, builder.and_(v, ir.Constant(_VB32, [15] * 32)),
                             builder.lshr(v, ir.Constant(_VB32, [4] * 32)))
    return i32x16(arr, index), codegen


@intrinsic
def fifth_bits_64(typingctx, arr, index, bit):
    """Bit `bit` of each of the 32 bytes arr[index:index+32] in byte lanes 0-31, bit `bit + 1` in lanes 32-63,
    each moved to bit 4 of its lane (Q5_K's fifth bits of a pair of sub-blocks, to `ior` onto its nibbles)."""
    if not (_is_array(arr, types.uint8) and _is_int(index) and _is_int(bit)):
        return None

    def codegen(context, builder, sig, args):
        v = builder.load(_lane_ptr(context, builder, sig.args[0], args[0], args[1], ir.IntType(8), 32), align=1)
        shift = builder.trunc(_int32(context, builder, args[2], sig.args[2]), ir.IntType(8))
        one, four = ir.Constant(_VB32, [1] * 32), ir.Constant(_VB32, [4] * 32)

        def bit_at(s):
            return builder.shl(builder.and_(builder.lshr(v, _splat(builder, s, _VB32)), one), four)
        return _nibble_lanes(builder, bit_at(shift), bit_at(builder.add(shift, ir.Constant(ir.IntType(8), 1))))
    return i32x16(arr, index, bit), codegen


@intrinsic
def dpbusd(typingctx, acc, a, b):
    """acc + the sum of the four products of byte lanes 4i..4i+3 in int32 lane i, a's bytes unsigned and b's
    signed (exact while it fits in int32): one vpdpbusd where MACHINE_HAS_VNNI; the same sums in plain
    vector code elsewhere."""
    if not (acc == i32x16 and a == i32x16 and b == i32x16):
        return None

    def codegen(context, builder, sig, args):
        if MACHINE_HAS_VNNI:
            fnty = ir.FunctionType(_VI16, [_VI16, _VI16, _VI16])
            return builder.call(builder.module.declare_intrinsic("llvm.x86.avx512.vpdpbusd.512", fnty=fnty),
                                list(args))
        bytes64, wide = ir.VectorType(ir.IntType(8), 64), ir.VectorType(_I32, 64)
        prod = builder.mul(builder.zext(builder.bitcast(args[1], bytes64), wide),
                           builder.sext(builder.bitcast(args[2], bytes64), wide))
        total = args[0]
        for j in range(4):
            total = builder.add(total, builder.shuffle_vector(prod, prod, ir.Constant(
                _VI16, [4 * i + j for i in range(WIDE_LANES)])))
        return total
    return i32x16(acc, a, b), codegen
