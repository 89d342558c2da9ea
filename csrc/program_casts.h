// Marks the casts a program asks for while autocast is on, so that the
// tracker can tell them from the casts autocast inserts (program_casts.cpp).
#pragma once

namespace torchcast {

// Whether this thread is inside a cast that passed an autocast dispatch key:
// one the program asked for. Autocast's own casts run with those keys
// excluded and never pass.
bool in_program_cast();

// Registers the kernel at aten::_to_copy's autocast keys, once per process;
// later calls do nothing.
void install_program_casts();

}  // namespace torchcast
