/*
 * Transcendental functions applied element by element, each element's result a function of
 * its own value alone: libm's scalar expf, log1pf, cosf, sinf and tanhf over a flat float32
 * array.
 *
 * torch computes exp, sigmoid, softplus and cos with a vector routine over most of a tensor
 * and libm over the tail that does not fill a vector; the two differ in the last bits, and
 * which elements fall in the tail depends on the tensor's size. So torch gave a row other
 * bits alone than among other rows. These do not: services/model/pointwise.py builds
 * DeepSeek-V4's sigmoid, softmax, softplus and SiLU on them, with IEEE arithmetic around.
 */
#include <math.h>
#include <stdint.h>

#define PARALLEL_ELEMS 16384

#define MAP(name, fn)                                                              \
    void name(const float *x, float *y, int64_t n) {                               \
        _Pragma("omp parallel for schedule(static) if (n >= PARALLEL_ELEMS)")      \
        for (int64_t i = 0; i < n; i++) y[i] = fn(x[i]);                           \
    }

MAP(map_exp, expf)
MAP(map_log1p, log1pf)
MAP(map_cos, cosf)
MAP(map_sin, sinf)
MAP(map_tanh, tanhf)
