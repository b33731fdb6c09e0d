// Benchmark task files: the first byte picks the loader (HellaSwag text, TruthfulQA MC1 / MC2
// JSON, query/choices JSONL, WinoGrande JSONL), the rest is the file. Loaded items are walked the
// way scoring walks them.
#include <cstddef>
#include <cstdint>
#include <string>

#include "eval/tasks.h"
#include "fuzz/fuzz_util.h"

using namespace focus;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const int which = data[0] % 5;
  static const char* names[] = {"hellaswag.txt", "mc_task.json", "mc_task.json", "arc.jsonl", "winogrande.jsonl"};
  const std::string path = fuzz::write_input(names[which], data + 1, size - 1);
  fuzz::guarded([&] {
    TaskSet t;
    switch (which) {
      case 0: t = load_hellaswag_txt(path); break;
      case 1: t = load_truthfulqa_mc(path, 1); break;
      case 2: t = load_truthfulqa_mc(path, 2); break;
      case 3: t = load_query_choices_jsonl(path, "arc_easy", "\nAnswer:"); break;
      default: t = load_winogrande_jsonl(path); break;
    }
    size_t bytes = 0;
    for (const TaskItem& it : t.items) {
      (void)it.gold();
      if (it.labels.size() != it.choices.size()) std::abort();  // every choice has a label
      if (!it.contexts.empty() && it.contexts.size() != it.choices.size()) std::abort();
      for (size_t c = 0; c < it.choices.size(); ++c) bytes += it.context_of(c).size() + it.choices[c].size();
    }
    (void)bytes;
  });
  return 0;
}
