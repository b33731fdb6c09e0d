// The training loop shared by the trainers of small parameter sets on a frozen model (Focus
// routers: retrofit.h; LoRA adapters: lora_train.h). A trainer describes what it trains as a
// TrainTask (flat parameter blocks, the loss and gradient of one window, validation, outputs and
// any extra checkpoint state); the loop owns everything else: the document split and windows,
// AdamW with warm-up + cosine, the progress bar, Ctrl-C, periodic validation, metrics.jsonl and
// the atomic checkpoint from which --resume continues to the same bits as an uninterrupted run.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "io/safetensors_writer.h"
#include "model/model.h"
#include "train/adamw.h"
#include "train/backward.h"
#include "train/data.h"

namespace focus {

struct TrainOptions {
  std::vector<std::string> train, valid;  // text files; a file is a document (split by document)
  int64_t ctx = 1024;
  int64_t steps = 100;
  int64_t batch = 4;                      // windows per step
  int64_t warmup = 10;
  AdamWConfig adam;
  int64_t eval_every = 50;                // validation every N steps (and at the end)
  int64_t valid_windows = 16;
  double checkpoint_seconds = 300;        // atomic checkpoint at least this often (and at the end)
  std::string out;                        // output folder
  bool resume = false;
  int64_t stop_after = 0;                 // end this run after N steps (0: run to --steps), as
                                          // an interruption: checkpoint written, --resume goes on
  uint64_t seed = 1;
  bool progress = true;
};

// The tokenized documents of a run and its fixed validation windows.
struct TrainData {
  int32_t bos = -1;
  std::vector<TokenDoc> train_docs, valid_docs;
  std::vector<std::vector<int32_t>> valid_ids, valid_targets;
};

// The options every checkpoint must share with the run that resumes it (model, data, schedule,
// optimizer, validation, seed); each trainer adds what shapes its own parameters.
nlohmann::json train_options_identity(const Model& m, const TrainOptions& o);

// Checks the options (errors start with `name`), creates the output folder, tokenizes the
// documents and cuts the validation windows.
TrainData prepare_train_data(const Model& m, const TrainOptions& o, const std::string& name);

enum class ValidPhase { Initial, Periodic, Final };

struct TrainTask {
  std::string name;         // "retrofit", "lora": progress label, log prefix, error prefix
  nlohmann::json identity;  // the settings a checkpoint must share with the run that resumes it
  // The trainable blocks (updated in place by AdamW, and by a resume, so views of their buffers stay
  // valid) and the checkpoint tensor prefix of each:
  // block b is stored as block_names[b] + "params" / "adam_m" / "adam_v".
  std::vector<std::vector<float>*> params;
  std::vector<std::string> block_names;
  // Optional, per block: whether AdamW's weight decay applies (empty: to every block).
  std::vector<bool> decay;
  // Loss sum of one window; accumulates loss_scale * d(loss sum)/dparams into grads (one buffer
  // per block, sized like it).
  std::function<double(const TrainWindow& w, float loss_scale, std::vector<std::vector<float>>& grads)> loss_and_grad;
  std::function<void()> after_step;  // optional: after each optimizer update
  // Optional: adds the task's own fields to the metrics.jsonl line of the step just taken.
  std::function<void(nlohmann::json& line)> step_metrics;
  // Validation metrics as a JSON object (logged under "valid"). `before` is the initial result
  // (null in the Initial phase).
  std::function<nlohmann::json(ValidPhase phase, int64_t step, const nlohmann::json& before)> validate;
  std::function<void()> save_outputs;  // writes the trained parameters into the output folder
  // Optional state beyond the blocks, carried by the checkpoint (tensors and metadata fields).
  std::function<void(std::map<std::string, io::F32Tensor>& tensors, nlohmann::json& meta)> save_state;
  std::function<void(const io::SafetensorsFile& file, const nlohmann::json& meta)> load_state;
};

// What a training run did; the results of `focus retrofit` and `focus lora` extend it.
struct TrainStats {
  int64_t steps = 0, train_tokens = 0;
  double seconds = 0, tokens_per_s = 0;
  bool interrupted = false;
};

struct TrainLoopResult : TrainStats {
  nlohmann::json before, after;  // validation at the start and at the end (after: null if interrupted)
};

// Trains task.params from the checkpoint in o.out (with o.resume) or from their current values;
// writes metrics.jsonl, checkpoint.safetensors and the task's outputs into o.out.
TrainLoopResult run_train_loop(const TrainOptions& o, const TrainData& d, TrainTask& task);

}  // namespace focus
