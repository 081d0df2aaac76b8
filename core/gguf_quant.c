/* ggml tensor types: names, block sizes and dequantisation to f32. The block layouts and formulas
 * are ggml's (ggml-common.h, ggml-quants.c); each block is read byte by byte, so a source of any
 * alignment works and the host's struct padding never matters. The order of the float operations is
 * ggml's, so results match its reference dequantiser bit for bit (the build uses -ffp-contract=off). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "uniprefill/gguf.h"

typedef struct {
  const char *name;
  int64_t block; /* elements per block */
  int64_t bytes; /* bytes per block */
} ggml_type_info;

#define QK_K 256

static const ggml_type_info type_info[UPF_GGML_TYPE_COUNT] = {
    [UPF_GGML_TYPE_F32] = {"f32", 1, 4},
    [UPF_GGML_TYPE_F16] = {"f16", 1, 2},
    [UPF_GGML_TYPE_Q4_0] = {"q4_0", 32, 2 + 16},
    [UPF_GGML_TYPE_Q4_1] = {"q4_1", 32, 2 + 2 + 16},
    [UPF_GGML_TYPE_Q5_0] = {"q5_0", 32, 2 + 4 + 16},
    [UPF_GGML_TYPE_Q5_1] = {"q5_1", 32, 2 + 2 + 4 + 16},
    [UPF_GGML_TYPE_Q8_0] = {"q8_0", 32, 2 + 32},
    [UPF_GGML_TYPE_Q8_1] = {"q8_1", 32, 4 + 4 + 32},
    [UPF_GGML_TYPE_Q2_K] = {"q2_K", QK_K, 2 + 2 + QK_K / 16 + QK_K / 4},
    [UPF_GGML_TYPE_Q3_K] = {"q3_K", QK_K, 2 + QK_K / 4 + QK_K / 8 + 12},
    [UPF_GGML_TYPE_Q4_K] = {"q4_K", QK_K, 2 + 2 + 12 + QK_K / 2},
    [UPF_GGML_TYPE_Q5_K] = {"q5_K", QK_K, 2 + 2 + 12 + QK_K / 8 + QK_K / 2},
    [UPF_GGML_TYPE_Q6_K] = {"q6_K", QK_K, QK_K / 2 + QK_K / 4 + QK_K / 16 + 2},
    [UPF_GGML_TYPE_Q8_K] = {"q8_K", QK_K, 4 + QK_K + QK_K / 8},
    [UPF_GGML_TYPE_IQ2_XXS] = {"iq2_xxs", QK_K, 2 + QK_K / 4},
    [UPF_GGML_TYPE_IQ2_XS] = {"iq2_xs", QK_K, 2 + QK_K / 4 + QK_K / 32},
    [UPF_GGML_TYPE_IQ3_XXS] = {"iq3_xxs", QK_K, 2 + QK_K / 4 + QK_K / 8},
    [UPF_GGML_TYPE_IQ1_S] = {"iq1_s", QK_K, 2 + QK_K / 8 + QK_K / 16},
    [UPF_GGML_TYPE_IQ4_NL] = {"iq4_nl", 32, 2 + 16},
    [UPF_GGML_TYPE_IQ3_S] = {"iq3_s", QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4},
    [UPF_GGML_TYPE_IQ2_S] = {"iq2_s", QK_K, 2 + QK_K / 4 + QK_K / 16},
    [UPF_GGML_TYPE_IQ4_XS] = {"iq4_xs", QK_K, 2 + 2 + QK_K / 2 + QK_K / 64},
    [UPF_GGML_TYPE_I8] = {"i8", 1, 1},
    [UPF_GGML_TYPE_I16] = {"i16", 1, 2},
    [UPF_GGML_TYPE_I32] = {"i32", 1, 4},
    [UPF_GGML_TYPE_I64] = {"i64", 1, 8},
    [UPF_GGML_TYPE_F64] = {"f64", 1, 8},
    [UPF_GGML_TYPE_IQ1_M] = {"iq1_m", QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32},
    [UPF_GGML_TYPE_BF16] = {"bf16", 1, 2},
    [UPF_GGML_TYPE_TQ1_0] = {"tq1_0", QK_K, 2 + 4 * 13},
    [UPF_GGML_TYPE_TQ2_0] = {"tq2_0", QK_K, 2 + QK_K / 4},
    [UPF_GGML_TYPE_MXFP4] = {"mxfp4", 32, 1 + 16},
    [UPF_GGML_TYPE_NVFP4] = {"nvfp4", 64, 4 + 32},
    [UPF_GGML_TYPE_Q1_0] = {"q1_0", 128, 2 + 16},
};

static const ggml_type_info *info_of(upf_ggml_type type) {
  if ((unsigned)type >= UPF_GGML_TYPE_COUNT || !type_info[type].name)
    return NULL;
  return &type_info[type];
}

const char *upf_ggml_type_name(upf_ggml_type type) {
  const ggml_type_info *ti = info_of(type);
  return ti ? ti->name : NULL;
}

int64_t upf_ggml_block_size(upf_ggml_type type) {
  const ggml_type_info *ti = info_of(type);
  return ti ? ti->block : 0;
}

int64_t upf_ggml_type_size(upf_ggml_type type) {
  const ggml_type_info *ti = info_of(type);
  return ti ? ti->bytes : 0;
}

int64_t upf_ggml_row_size(upf_ggml_type type, int64_t n) {
  const ggml_type_info *ti = info_of(type);
  if (!ti || n < 0 || n % ti->block)
    return -1;
  int64_t blocks = n / ti->block;
  if (blocks > INT64_MAX / ti->bytes)
    return -1;
  return blocks * ti->bytes;
}

int upf_ggml_can_dequantize(upf_ggml_type type) {
  switch (type) {
  case UPF_GGML_TYPE_F32:
  case UPF_GGML_TYPE_F16:
  case UPF_GGML_TYPE_BF16:
  case UPF_GGML_TYPE_F64:
  case UPF_GGML_TYPE_Q4_0:
  case UPF_GGML_TYPE_Q4_1:
  case UPF_GGML_TYPE_Q5_0:
  case UPF_GGML_TYPE_Q5_1:
  case UPF_GGML_TYPE_Q8_0:
  case UPF_GGML_TYPE_Q4_K:
  case UPF_GGML_TYPE_Q5_K:
  case UPF_GGML_TYPE_Q6_K:
    return 1;
  default:
    return 0;
  }
}

/* IEEE half to float, exact (subnormals, infinities and NaN included). */
static float half_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp == 0) {
    /* zero or subnormal: man * 2^-24, exact in float */
    float f = (float)man * 0x1p-24f;
    memcpy(&u, &f, sizeof u);
    u |= sign;
  } else {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static uint32_t rd32(const uint8_t *p) {
  return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static float f16_at(const uint8_t *p) { return half_to_f32(rd16(p)); }

/* Q4_0: d (f16), qs[16]; element j = d * (low nibble of qs[j] - 8), element j+16 = d * (high - 8). */
static void dq_q4_0(const uint8_t *b, float *y) {
  float d = f16_at(b);
  const uint8_t *qs = b + 2;
  for (int j = 0; j < 16; j++) {
    y[j] = (float)((qs[j] & 0x0f) - 8) * d;
    y[j + 16] = (float)((qs[j] >> 4) - 8) * d;
  }
}

/* Q4_1: d, m (f16), qs[16]; element = q * d + m. */
static void dq_q4_1(const uint8_t *b, float *y) {
  float d = f16_at(b), m = f16_at(b + 2);
  const uint8_t *qs = b + 4;
  for (int j = 0; j < 16; j++) {
    y[j] = (float)(qs[j] & 0x0f) * d + m;
    y[j + 16] = (float)(qs[j] >> 4) * d + m;
  }
}

/* Q5_0: d (f16), qh (32 fifth bits, little-endian u32), qs[16]; element = d * (q5 - 16). Bit j of qh
 * is the fifth bit of element j, bit j+16 that of element j+16. */
static void dq_q5_0(const uint8_t *b, float *y) {
  float d = f16_at(b);
  uint32_t qh = rd32(b + 2);
  const uint8_t *qs = b + 6;
  for (int j = 0; j < 16; j++) {
    int x0 = (int)((qs[j] & 0x0f) | (((qh >> j) & 1u) << 4)) - 16;
    int x1 = (int)((qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4)) - 16;
    y[j] = (float)x0 * d;
    y[j + 16] = (float)x1 * d;
  }
}

/* Q5_1: d, m (f16), qh, qs[16]; element = q5 * d + m. */
static void dq_q5_1(const uint8_t *b, float *y) {
  float d = f16_at(b), m = f16_at(b + 2);
  uint32_t qh = rd32(b + 4);
  const uint8_t *qs = b + 8;
  for (int j = 0; j < 16; j++) {
    int x0 = (int)((qs[j] & 0x0f) | (((qh >> j) & 1u) << 4));
    int x1 = (int)((qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4));
    y[j] = (float)x0 * d + m;
    y[j + 16] = (float)x1 * d + m;
  }
}

/* Q8_0: d (f16), qs[32] (int8); element = q * d. */
static void dq_q8_0(const uint8_t *b, float *y) {
  float d = f16_at(b);
  for (int j = 0; j < 32; j++)
    y[j] = (float)(int8_t)b[2 + j] * d;
}

/* The 6-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K block, packed in 12 bytes: sub-blocks
 * 0..3 in the low 6 bits of bytes j and j+4; sub-blocks 4..7 in the nibbles of byte j+4 with their
 * top two bits in the high bits of bytes j-4 (scale) and j (min). */
static void k_scale_min(int j, const uint8_t *q, int *sc, int *m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

/* Q4_K: d, dmin (f16), scales[12], qs[128]; 8 sub-blocks of 32. Each 32 bytes of qs hold two
 * sub-blocks: low nibbles the first, high nibbles the second. element = d*sc * q - dmin*m. */
static void dq_q4_k(const uint8_t *b, float *y) {
  float d = f16_at(b), dmin = f16_at(b + 2);
  const uint8_t *scales = b + 4, *q = b + 16;
  for (int j = 0, is = 0; j < QK_K; j += 64, is += 2, q += 32) {
    int sc, m;
    k_scale_min(is, scales, &sc, &m);
    float d1 = d * (float)sc, m1 = dmin * (float)m;
    k_scale_min(is + 1, scales, &sc, &m);
    float d2 = d * (float)sc, m2 = dmin * (float)m;
    for (int l = 0; l < 32; l++)
      *y++ = d1 * (float)(q[l] & 0x0f) - m1;
    for (int l = 0; l < 32; l++)
      *y++ = d2 * (float)(q[l] >> 4) - m2;
  }
}

/* Q5_K: as Q4_K with qh[32] after the scales: bit 2i (2i+1) of qh[l] is the fifth bit of element l of
 * the first (second) sub-block of pair i. */
static void dq_q5_k(const uint8_t *b, float *y) {
  float d = f16_at(b), dmin = f16_at(b + 2);
  const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + 48;
  unsigned u1 = 1, u2 = 2;
  for (int j = 0, is = 0; j < QK_K; j += 64, is += 2, ql += 32, u1 <<= 2, u2 <<= 2) {
    int sc, m;
    k_scale_min(is, scales, &sc, &m);
    float d1 = d * (float)sc, m1 = dmin * (float)m;
    k_scale_min(is + 1, scales, &sc, &m);
    float d2 = d * (float)sc, m2 = dmin * (float)m;
    for (int l = 0; l < 32; l++)
      *y++ = d1 * (float)((ql[l] & 0x0f) + (qh[l] & u1 ? 16 : 0)) - m1;
    for (int l = 0; l < 32; l++)
      *y++ = d2 * (float)((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
  }
}

/* Q6_K: ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (int8, one per 16 elements), d (f16).
 * Per half of 128 elements: ql 64 bytes, qh 32 bytes, 8 scales; element l + 32k (k = 0..3, l < 32)
 * takes its low nibble from ql[l + 32*(k&1)] (low nibble for k < 2, high for k >= 2), its high two
 * bits from bits 2k..2k+1 of qh[l], and scale sc[l/16 + 2k]; element = d * sc * (q6 - 32). */
static void dq_q6_k(const uint8_t *b, float *y) {
  const uint8_t *ql = b, *qh = b + 128;
  const int8_t *sc = (const int8_t *)(b + 192);
  float d = f16_at(b + 208);
  for (int n = 0; n < QK_K; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
    for (int l = 0; l < 32; l++) {
      int is = l / 16;
      int q1 = (int)((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
      int q2 = (int)((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
      int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * (float)sc[is] * (float)q1;
      y[l + 32] = d * (float)sc[is + 2] * (float)q2;
      y[l + 64] = d * (float)sc[is + 4] * (float)q3;
      y[l + 96] = d * (float)sc[is + 6] * (float)q4;
    }
  }
}

upf_status upf_ggml_dequantize(upf_ggml_type type, const void *src, int64_t n, float *dst) {
  const ggml_type_info *ti = info_of(type);
  if (!ti || !upf_ggml_can_dequantize(type))
    return upf_fail(UPF_ERR_DTYPE, "dequantize: ggml type %d (%s) is not supported", (int)type,
                    ti ? ti->name : "unknown");
  if (n < 0 || n % ti->block)
    return upf_fail(UPF_ERR_SHAPE, "dequantize: %lld elements of %s is not a whole number of %lld-element blocks",
                    (long long)n, ti->name, (long long)ti->block);
  const uint8_t *s = (const uint8_t *)src;
  int64_t nb = n / ti->block;
  switch (type) {
  case UPF_GGML_TYPE_F32:
    memcpy(dst, s, (size_t)n * sizeof(float));
    break;
  case UPF_GGML_TYPE_F16:
    for (int64_t i = 0; i < n; i++)
      dst[i] = half_to_f32(rd16(s + 2 * i));
    break;
  case UPF_GGML_TYPE_BF16:
    for (int64_t i = 0; i < n; i++) {
      uint32_t u = (uint32_t)rd16(s + 2 * i) << 16;
      memcpy(&dst[i], &u, sizeof u);
    }
    break;
  case UPF_GGML_TYPE_F64:
    for (int64_t i = 0; i < n; i++) {
      double v;
      memcpy(&v, s + 8 * i, sizeof v);
      dst[i] = (float)v;
    }
    break;
  default: {
    void (*fn)(const uint8_t *, float *) = type == UPF_GGML_TYPE_Q4_0   ? dq_q4_0
                                           : type == UPF_GGML_TYPE_Q4_1 ? dq_q4_1
                                           : type == UPF_GGML_TYPE_Q5_0 ? dq_q5_0
                                           : type == UPF_GGML_TYPE_Q5_1 ? dq_q5_1
                                           : type == UPF_GGML_TYPE_Q8_0 ? dq_q8_0
                                           : type == UPF_GGML_TYPE_Q4_K ? dq_q4_k
                                           : type == UPF_GGML_TYPE_Q5_K ? dq_q5_k
                                                                        : dq_q6_k;
    for (int64_t i = 0; i < nb; i++)
      fn(s + i * ti->bytes, dst + i * ti->block);
  }
  }
  return UPF_OK;
}

upf_status upf_gguf_tensor_rows_to_f32(const upf_gguf_tensor *t, int64_t row0, int64_t nrows, float *dst) {
  int64_t ne0 = t->ne[0], rows = ne0 ? t->n_elements / ne0 : 0;
  if (row0 < 0 || nrows < 0 || row0 > rows || nrows > rows - row0)
    return upf_fail(UPF_ERR_INVALID_ARG, "tensor '%s': rows [%lld, %lld) outside its %lld rows", t->name,
                    (long long)row0, (long long)row0 + (long long)nrows, (long long)rows);
  if (!upf_ggml_can_dequantize(t->type)) {
    const char *tn = upf_ggml_type_name(t->type);
    return upf_fail(UPF_ERR_DTYPE, "tensor '%s': type %s cannot be dequantised", t->name, tn ? tn : "unknown");
  }
  int64_t row_bytes = upf_ggml_row_size(t->type, ne0);
  if (row_bytes < 0)
    return upf_fail(UPF_ERR_SHAPE, "tensor '%s': ne[0] = %lld is not a whole number of blocks", t->name,
                    (long long)ne0);
  upf_status st = upf_ggml_dequantize(t->type, (const uint8_t *)t->data + row0 * row_bytes, nrows * ne0, dst);
  if (st != UPF_OK) {
    char ctx[320];
    snprintf(ctx, sizeof ctx, "tensor '%s': ", t->name);
    return upf_fail_context(st, ctx);
  }
  return UPF_OK;
}

upf_status upf_gguf_tensor_to_f32(const upf_gguf_tensor *t, float *dst) {
  int64_t ne0 = t->ne[0];
  return upf_gguf_tensor_rows_to_f32(t, 0, ne0 ? t->n_elements / ne0 : 0, dst);
}
