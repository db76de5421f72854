// The `infcl` op library: every native op's schema, in one place (the kernel files register their CPU
// implementations with TORCH_LIBRARY_IMPL beside the code). Python's fake (meta) functions for torch.compile:
// infcl/backends/native/build.py.

#include <torch/library.h>

TORCH_LIBRARY(infcl, m) {
  // the softmax (InfoNCE / CLIP) loss: softmax_ops.cpp
  m.def("forward_block(Tensor q, Tensor k, float scale, Tensor pos, bool symmetric) -> (Tensor, Tensor)");
  m.def(
      "backward_block(Tensor q, Tensor k, float scale, Tensor pos, Tensor row_stats, Tensor g_row, "
      "Tensor? col_stats, Tensor? g_col, Tensor(a!) dq, Tensor(b!) dk) -> Tensor");
  m.def(
      "masked_forward_block(Tensor q, Tensor k, float scale, Tensor pos, bool symmetric, str? multi_positive, "
      "Tensor? q_ids, Tensor? k_ids, Tensor? guide_q, Tensor? guide_k, Tensor? row_threshold, "
      "Tensor? col_threshold, bool kept_sums=False) -> (Tensor, Tensor)");
  m.def(
      "masked_backward_block(Tensor q, Tensor k, float scale, Tensor pos, Tensor row_stats, Tensor g_row, "
      "Tensor? col_stats, Tensor? g_col, str? multi_positive, Tensor? q_ids, Tensor? k_ids, Tensor? guide_q, "
      "Tensor? guide_k, Tensor? row_threshold, Tensor? col_threshold, Tensor? row_pos_count, "
      "Tensor? row_pos_stats, Tensor? col_pos_count, Tensor? col_pos_stats, Tensor(a!) dq, Tensor(b!) dk, "
      "Tensor? row_uniform=None, Tensor? col_uniform=None) -> Tensor");
  m.def("guide_label_scores(Tensor guide_q, Tensor guide_k, Tensor pos) -> Tensor");
  // every Matryoshka prefix's softmax loss in one pass: softmax_ops.cpp (kernels: matryoshka_*.cpp)
  m.def(
      "matryoshka_forward_block(Tensor q, Tensor k, float scale, Tensor pos, bool symmetric, int[] dims, "
      "bool[] renormalize) -> (Tensor, Tensor)");
  m.def(
      "matryoshka_backward_block(Tensor q, Tensor k, float scale, Tensor pos, int[] dims, bool[] renormalize, "
      "Tensor row_stats, Tensor g_row, Tensor? col_stats, Tensor? g_col, Tensor(a!) dq, Tensor(b!) dk) -> Tensor");
  // ... with the mask options (the masked ops' arguments; the positives' counts or stats per prefix)
  m.def(
      "masked_matryoshka_forward_block(Tensor q, Tensor k, float scale, Tensor pos, bool symmetric, int[] dims, "
      "bool[] renormalize, str? multi_positive, Tensor? q_ids, Tensor? k_ids, Tensor? guide_q, Tensor? guide_k, "
      "Tensor? row_threshold, Tensor? col_threshold) -> (Tensor, Tensor)");
  m.def(
      "masked_matryoshka_backward_block(Tensor q, Tensor k, float scale, Tensor pos, int[] dims, bool[] renormalize, "
      "Tensor row_stats, Tensor g_row, Tensor? col_stats, Tensor? g_col, str? multi_positive, Tensor? q_ids, "
      "Tensor? k_ids, Tensor? guide_q, Tensor? guide_k, Tensor? row_threshold, Tensor? col_threshold, "
      "Tensor? row_pos_count, Tensor? row_pos_stats, Tensor? col_pos_count, Tensor? col_pos_stats, "
      "Tensor(a!) dq, Tensor(b!) dk) -> Tensor");
  // the sigmoid (SigLIP) loss: infcl_siglip.cpp
  // (q, k, scale, pos, ...) as the softmax ops have it, then the sigmoid loss's bias; the ids (the positives
  // in place of pos) last, optional.
  m.def(
      "sigmoid_forward_block(Tensor q, Tensor k, float scale, Tensor pos, float bias, Tensor? q_ids=None, "
      "Tensor? k_ids=None) -> Tensor");
  m.def(
      "sigmoid_backward_block(Tensor q, Tensor k, float scale, Tensor pos, float bias, Tensor g_row, "
      "Tensor(a!) dq, Tensor(b!) dk, Tensor? q_ids=None, Tensor? k_ids=None) -> Tensor");
  // distillation: distill.cpp
  m.def(
      "distill_forward_block(Tensor q, Tensor k, float scale, Tensor teacher_q, Tensor teacher_k, "
      "float teacher_scale, bool symmetric) -> (Tensor, Tensor)");
  m.def(
      "distill_backward_block(Tensor q, Tensor k, float scale, Tensor teacher_q, Tensor teacher_k, "
      "float teacher_scale, Tensor row_stats, Tensor g_row, Tensor? col_stats, Tensor? g_col, Tensor(a!) dq, "
      "Tensor(b!) dk) -> Tensor");
  // retrieval ranks: retrieval.cpp
  m.def(
      "rank_best_positives(Tensor q, Tensor k, Tensor pos, Tensor row_index, Tensor col_index, bool symmetric, "
      "Tensor? q_ids, Tensor? k_ids) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "rank_ahead_counts(Tensor q, Tensor k, Tensor row_score, Tensor row_best, Tensor? col_score, "
      "Tensor? col_best, Tensor row_index, Tensor col_index, Tensor? q_ids, Tensor? k_ids) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  // top-k: topk.cpp
  m.def(
      "topk_block_(Tensor q, Tensor k, Tensor col_index, Tensor(a!) key, Tensor(b!) index, Tensor(c!) nan, "
      "bool largest, Tensor? pos, Tensor? q_ids, Tensor? k_ids) -> ()");
  // the MaxSim (late-interaction) loss: maxsim.cpp
  m.def("maxsim_scores(Tensor q, Tensor docs, Tensor q_weight, Tensor? docs_mask, bool with_winners) -> (Tensor, Tensor)");
  m.def(
      "maxsim_route_(Tensor q, Tensor docs, Tensor winners, Tensor coef, Tensor q_weight, Tensor(a!) dq, "
      "Tensor(b!) dk) -> ()");
}
