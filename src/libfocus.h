// The public API of libfocus in one include: loading models (GGUF, safetensors, llama2.c) and
// their tokenizers, the forward pass with per-layer attention policies, generation, perplexity
// and multiple-choice scoring, Focus routers and their attention plans, text preparation and
// thread control. Link with focus::focus (find_package(focus)).
#pragma once

#include "core/error.h"
#include "core/threads.h"
#include "eval/perplexity.h"
#include "eval/tasks.h"
#include "focus/focus_attention.h"
#include "focus/focus_model.h"
#include "io/text.h"
#include "io/tokenizer.h"
#include "model/attention.h"
#include "model/generate.h"
#include "model/model.h"
