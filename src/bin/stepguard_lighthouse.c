/* stepguard-lighthouse: the lighthouse as a plain C executable. */
#include "stepguard/lighthouse.h"

int main(int argc, char **argv) { return sg_lh_main(argc, argv); }
