/* stepguard-lighthouse: the lighthouse as a plain C executable. */
#include <signal.h>

#include "stepguard/lighthouse.h"

int main(int argc, char **argv) {
  /* a peer that resets its connection must not kill the server */
  signal(SIGPIPE, SIG_IGN);
  return sg_lh_main(argc, argv);
}
