// Renamed to focus/balancing.h. Kept only for src/model/forward.cpp, which still includes this
// name; remove once that include reads "focus/balancing.h".
#pragma once
#include "focus/balancing.h"
