// Marks the casts a program asks for while autocast is on, so that the
// tracker can tell them from the casts autocast inserts (program_casts.cpp).
#pragma once

namespace torchcast {

// Whether this thread is inside a cast that passed an autocast dispatch key:
// one the program asked for. Autocast's own casts run with those keys
// excluded and never pass.
bool in_program_cast();

}  // namespace torchcast
