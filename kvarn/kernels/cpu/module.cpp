// The Python bindings of the CPU kernels (decode.cpp, store.cpp): one extension module, built by build.py.
#include <torch/extension.h>

#include <vector>

std::vector<at::Tensor> decode_attention(
    const at::Tensor& q, const at::Tensor& qh, const at::Tensor& hmat, double scale, const std::vector<at::Tensor>& kf,
    const std::vector<int64_t>& ks, int64_t k_bits, int64_t k_rotate, const std::vector<at::Tensor>& vf,
    const std::vector<int64_t>& vs, int64_t v_bits, int64_t v_rotate, const at::Tensor& block_table,
    const at::Tensor& n_blocks, int64_t tile, const at::Tensor& exact_map, const at::Tensor& exact_k,
    const at::Tensor& exact_v, const std::vector<at::Tensor>& dense_k, const std::vector<at::Tensor>& dense_v,
    const std::vector<int64_t>& dense_pos, int64_t tiles_pos, const at::Tensor& bias, int64_t L, double softcap,
    int64_t splits, const at::Tensor& paged_rows, const at::Tensor& paged_index, int64_t paged_pos);

std::vector<at::Tensor> store_tiles(const at::Tensor& x, const at::Tensor& weight, int64_t bits, bool channel,
                                    int64_t rotate, bool use_varn, int64_t iters, int64_t scale_dt, int64_t col_dt,
                                    bool relative, const at::Tensor& coef, double clip, int64_t widths);

at::Tensor query_aware_coefficients(const at::Tensor& sigma, int64_t rotate, double damp);

at::Tensor tile_decode(const at::Tensor& codes, const at::Tensor& a, const at::Tensor& z, const at::Tensor& col,
                       const at::Tensor& rot, int64_t bits, bool channel, int64_t rotate, int64_t tile, int64_t out_dt);

void write_rows(at::Tensor rows, const at::Tensor& key, const at::Tensor& value, const at::Tensor& tok,
                const at::Tensor& blk, const at::Tensor& sub);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "fused decode attention over packed KVarN tiles");
  m.def("query_aware_coefficients", &query_aware_coefficients,
        "query-aware rounding's coefficients per tile and basis (kvarn.ops.rtn.query_aware_bases)");
  m.def("write_rows", &write_rows, "a decode step's fresh K/V rows into their fp slots (vLLM pages)");
  m.def("store_tiles", &store_tiles, "fused tile store: Hadamard, VarN, RTN, fold, pack (AffineQuantizer tiles)");
  m.def("tile_decode", &tile_decode, "the store's inverse: AffineQuantizer tiles decoded, token-major");
}
