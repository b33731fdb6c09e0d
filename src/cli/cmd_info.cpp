// focus info MODEL: architecture, sizes, parameter count, tensor types.
#include <cstdio>
#include <iostream>

#include "cli/setup.h"
#include "model/model_info.h"

namespace focus::cli {

Command add_info(CLI::App& app) {
  auto s = std::make_shared<ModelSetup>();
  auto* sub = app.add_subcommand("info", "architecture, sizes, parameter count, tensor types");
  s->add_model(sub, true, true);
  s->add_json(sub, "print JSON");
  return {sub, [s] {
            const Loaded l = s->load();
            if (s->as_json)
              std::cout << model_info_json(*l.model).dump() << "\n";
            else
              std::fputs(model_info_text(*l.model).c_str(), stdout);
            return 0;
          }};
}

}  // namespace focus::cli
