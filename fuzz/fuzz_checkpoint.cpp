// Training checkpoints: the input is written as OUT/checkpoint.safetensors and a run resumes from
// it (run_train_loop with resume, zero steps, no documents), with two parameter blocks ("a." of 6
// values and "b." of 4) and a task identity of {"fuzz": 1}. The task's load_state reads extra
// state from the checkpoint the way the trainers do (a tensor and metadata arrays).
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "fuzz/fuzz_util.h"
#include "train/trainer.h"

using namespace focus;
using json = nlohmann::json;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string out = fuzz::fresh_dir("train");
  fuzz::write_bytes(out + "/checkpoint.safetensors",
                    std::string_view(reinterpret_cast<const char*>(data), size));
  std::vector<float> a(6, 0.f), b(4, 0.f), extra(3, 0.f);
  std::vector<double> load;
  std::vector<float> far;
  TrainTask task;
  task.name = "fuzz";
  task.identity = {{"fuzz", 1}};
  task.params = {&a, &b};
  task.block_names = {"a.", "b."};
  task.loss_and_grad = [](const TrainWindow&, float, std::vector<std::vector<float>>&) { return 0.0; };
  task.validate = [](ValidPhase, int64_t, const json&) { return json::object(); };
  task.save_outputs = [] {};
  task.save_state = [&](std::map<std::string, io::F32Tensor>& t, json& meta) {
    t["extra"] = {{(int64_t)extra.size()}, extra};
    meta["far_mass"] = far;
  };
  task.load_state = [&](const io::SafetensorsFile& file, const json& meta) {
    if (file.find("extra")) {
      std::vector<float> v = file.to_float(file.tensor("extra"));
      FOCUS_CHECK(v.size() == extra.size(), file.path(), ": tensor 'extra' has ", v.size(), " values");
      extra = std::move(v);
    }
    if (meta.contains("balance_load") && meta["balance_load"].size() > 0)
      load = meta["balance_load"][0].get<std::vector<double>>();
    if (meta.contains("far_mass")) far = meta["far_mass"].get<std::vector<float>>();
  };
  TrainOptions o;
  o.out = out;
  o.resume = true;
  o.steps = 0;
  o.batch = 1;
  o.ctx = 8;
  o.progress = false;
  o.checkpoint_seconds = 1e9;
  TrainData d;
  fuzz::guarded([&] { (void)run_train_loop(o, d, task); });
  return 0;
}
